"""One row change of a captured table, and its Kafka record (format: docs/cdc.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

Op = Literal["insert", "update", "delete"]


@dataclass(frozen=True, order=True)
class Position:
    """Where a change is in the WAL: its transaction's commit LSN, then its place in it.
    Positions order the changes of every table."""

    lsn: int
    seq: int

    def __str__(self) -> str:
        return f"{self.lsn}.{self.seq}"

    @classmethod
    def parse(cls, text: str) -> Position:
        lsn, _, seq = text.partition(".")
        if not (lsn.isdigit() and seq.isdigit()):
            raise ValueError(f"{text!r} is not a changelog position")
        return cls(int(lsn), int(seq))


@dataclass(frozen=True)
class Change:
    table: str
    op: Op
    key: dict[str, Any]
    row: dict[str, Any] | None  # None for a delete
    before: dict[str, Any] | None  # the old row of an update or delete
    position: Position
    size: int = field(default=0, compare=False)  # bytes of its record (what it weighs queued)


def _json(value: Any, canonical: bool = False) -> bytes:
    return json.dumps(value, sort_keys=canonical, separators=(",", ":")).encode()


def record_for(
    change: Change, committed_at: datetime | None
) -> tuple[bytes, bytes | None, list[tuple[str, bytes]]]:
    """(key, value, headers) of the change's Kafka record; a delete is a tombstone."""
    headers = [("op", change.op.encode()), ("position", str(change.position).encode())]
    if committed_at is not None:
        stamp = committed_at.astimezone(UTC).isoformat().replace("+00:00", "Z")
        headers.append(("committed_at", stamp.encode()))
    if change.op == "delete":
        headers.append(("before", _json(change.before)))
        return _json(change.key, canonical=True), None, headers
    value = _json({"row": change.row, "before": change.before})
    return _json(change.key, canonical=True), value, headers


def from_record(
    table: str, key: bytes, value: bytes | None, headers: list[tuple[str, bytes]]
) -> Change:
    """The change a `cdc.<table>` record carries (the inverse of `record_for`)."""
    h = {k: v for k, v in headers}
    op: Op = h["op"].decode()  # type: ignore[assignment]
    position = Position.parse(h["position"].decode())
    if value is None:
        before = json.loads(h["before"]) if "before" in h else None
        return Change(table, "delete", json.loads(key), None, before, position, len(key))
    body = json.loads(value)
    size = len(key) + len(value)
    return Change(table, op, json.loads(key), body["row"], body.get("before"), position, size)
