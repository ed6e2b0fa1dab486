"""Reference data a command may need from other aggregates (e.g. does this customer exist?)."""

from __future__ import annotations

from typing import Protocol


class References(Protocol):
    """Read-only access to the current state of other aggregates.

    In command processing this is a replica of the snapshot topic, caught up to the log's end
    before a command that needs it is decided; see docs/consistency.md for what that covers.
    """

    def get(self, aggregate_type: str, aggregate_id: str) -> object | None: ...


class NoReferences:
    def get(self, aggregate_type: str, aggregate_id: str) -> object | None:
        return None
