"""Why a command was refused, as values with the codes of docs/api.md's error table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rejected(Exception):
    code: str
    message: str
    details: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def rule_violated(message: str) -> Rejected:
    return Rejected("rule_violated", message)


def not_found(message: str) -> Rejected:
    return Rejected("not_found", message)


def gone(message: str) -> Rejected:
    """The aggregate was erased: nothing can be done to it any more."""
    return Rejected("gone", message)


def invalid(message: str, details: list[dict[str, Any]] | None = None) -> Rejected:
    return Rejected("validation_failed", message, details or [])


def version_conflict(expected: int, actual: int) -> Rejected:
    return Rejected(
        "version_conflict",
        f"expected version {expected} but the aggregate is at version {actual}",
        [{"expected_version": expected, "actual_version": actual}],
    )
