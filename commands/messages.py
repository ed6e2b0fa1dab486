"""What travels on the commands and replies topics between API processes and processors."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from events.serialization import dumps, loads


@dataclass(frozen=True)
class CommandMessage:
    command_id: str
    name: str
    aggregate_type: str
    aggregate_id: str
    expected_version: int | None
    data: dict[str, Any]
    reply_to: str
    deadline: float  # epoch seconds; a processor neither decides nor commits it after that
    correlation_id: str
    subject: str
    idempotency_key: str | None = None
    fingerprint: str | None = None

    def encode(self) -> bytes:
        return dumps(self)

    @classmethod
    def decode(cls, raw: bytes) -> CommandMessage:
        return cls(**loads(raw))


@dataclass(frozen=True)
class Reply:
    """A command's outcome: an HTTP status and body, exactly as the API will answer."""

    command_id: str
    status: int
    body: dict[str, Any]
    replay: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def encode_many(replies: Iterable[Reply]) -> bytes:
        """One record for the replies a transaction sends to one API process."""
        return dumps(list(replies))

    @classmethod
    def decode_many(cls, raw: bytes) -> list[Reply]:
        doc = loads(raw)
        return [cls(**r) for r in doc] if isinstance(doc, list) else [cls(**doc)]


def error_body(code: str, message: str, details: list[Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or []}}


@dataclass(frozen=True)
class LogPosition:
    """Where a command's last event sits in the log: read models compare their progress to it."""

    topic: str
    partition: int
    offset: int

    def token(self) -> str:
        raw = json.dumps([self.topic, self.partition, self.offset], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def parse(cls, token: str) -> LogPosition:
        """Raise ValueError on anything that is not a token this module made."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            topic, partition, offset = json.loads(raw)
        except Exception as e:
            raise ValueError(f"not a position token: {token!r}") from e
        if not (isinstance(topic, str) and isinstance(partition, int) and isinstance(offset, int)):
            raise ValueError(f"not a position token: {token!r}")
        return cls(topic, partition, offset)
