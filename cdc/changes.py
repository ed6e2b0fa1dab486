"""One row change of a captured table, and its Kafka record (format: docs/cdc.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from events.base import ERASED

Op = Literal["insert", "update", "delete"]


@dataclass(frozen=True, order=True)
class WalPosition:
    """Where a change is in the WAL: its transaction's commit LSN, then its place in it.
    Positions order the changes of every table."""

    lsn: int
    seq: int

    def __str__(self) -> str:
        return f"{self.lsn}.{self.seq}"

    @classmethod
    def parse(cls, text: str) -> WalPosition:
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
    position: WalPosition
    size: int = field(default=0, compare=False)  # bytes of its record (what it weighs queued)
    xid: int | None = field(default=None, compare=False)  # its transaction (32-bit); None: the
    # slot's first snapshot
    # A row of the slot's first snapshot: the MVCC snapshot it was read in. A reader whose own
    # snapshot does not cover it read the table before the slot existed, and the changes made
    # between the two were never streamed (see app/hub.py).
    snapshot: Snapshot | None = field(default=None, compare=False)


XID_SPAN = 1 << 32
COVERS_SPAN = 1 << 20  # `Snapshot.covers` looks at no more transactions (else: not covered)


def seen_as(filter: dict[str, Any], change: Change) -> str | None:
    """How a subscriber of the rows matching `filter` (column -> value, in wire form) sees
    `change`: rows entering or staying in the filter are `upsert`s, rows leaving it (or deleted)
    are `delete`s; None when it does not concern the subscriber. Every push protocol (websocket,
    server-sent events, long-polling, webhooks) sees changes this way."""

    def matches(row: dict[str, Any] | None, erased: bool = False) -> bool:
        return row is not None and all(
            row.get(c) == v or (erased and row.get(c) == ERASED) for c, v in filter.items()
        )

    if matches(change.row):
        return "upsert"
    # An erased value in the before image was some value (`record_for` erases it there too):
    # it may have matched, and the row is no longer the subscriber's to keep.
    if matches(change.before, erased=True) or (change.op == "delete" and change.before is None):
        return "delete"
    return None


def widen(xid: int, near: int) -> int:
    """A 32-bit transaction id as the 64-bit one (epoch and xid, as `pg_current_snapshot()`
    gives them) nearest to `near`: ids within 2^31 of each other compare right."""
    full = (near & ~(XID_SPAN - 1)) | (xid & (XID_SPAN - 1))
    if full - near > XID_SPAN // 2:
        return full - XID_SPAN
    if near - full > XID_SPAN // 2:
        return full + XID_SPAN
    return full


@dataclass(frozen=True)
class Snapshot:
    """A Postgres MVCC snapshot (`pg_current_snapshot()`): which transactions it sees. Every
    transaction below `xmin` had ended; from `xmax` on none had started; those in `xip` were
    running. A websocket snapshot read in it holds exactly the changes of the transactions it
    sees; every other change comes after it in the stream."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        """`xmin:xmax:xip,…` (Postgres's text form, and the token a client resumes from)."""
        parts = text.split(":")
        try:
            xmin, xmax = int(parts[0]), int(parts[1])
            xip = (
                frozenset(int(x) for x in parts[2].split(",") if x)
                if len(parts) > 2
                else frozenset()
            )
        except (ValueError, IndexError) as e:
            raise ValueError(f"{text!r} is not a snapshot") from e
        if len(parts) != 3 or not 0 < xmin <= xmax or any(not xmin <= x < xmax for x in xip):
            raise ValueError(f"{text!r} is not a snapshot")
        return cls(xmin, xmax, xip)

    def __str__(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(str(x) for x in sorted(self.xip))}"

    def covers(self, other: Snapshot) -> bool:
        """Whether this snapshot sees every transaction `other` sees (it was taken at the same
        time or later). Snapshots far apart are told by their bounds alone; close ones (which
        can see each other's running transactions differently) transaction by transaction."""
        if other.xmax <= self.xmin:
            return True
        if other.xmax > self.xmax or other.xmax - self.xmin > COVERS_SPAN:
            return False
        return all(self._visible(x) for x in range(self.xmin, other.xmax) if other._visible(x))

    def sees(self, xid: int | None) -> bool:
        """Whether the transaction `xid` (32-bit, from the WAL) is in this snapshot. The rows
        of the slot's first snapshot (no xid) are taken as seen: a reader's snapshot that does
        not cover theirs (`covers`) is not served (app/hub.py)."""
        if xid is None:
            return True
        return self._visible(widen(xid, self.xmax))

    def _visible(self, full: int) -> bool:
        """Whether the transaction `full` (64-bit) is in this snapshot."""
        return full < self.xmin or (full < self.xmax and full not in self.xip)


def _json(value: Any, canonical: bool = False) -> bytes:
    return json.dumps(value, sort_keys=canonical, separators=(",", ":")).encode()


def record_for(
    change: Change, committed_at: datetime | None
) -> tuple[bytes, bytes | None, list[tuple[str, bytes]]]:
    """(key, value, headers) of the change's Kafka record; a delete is a tombstone."""
    headers = [("op", change.op.encode()), ("position", str(change.position).encode())]
    if change.xid is not None:
        headers.append(("xid", str(change.xid).encode()))
    if change.snapshot is not None:
        headers.append(("snapshot", str(change.snapshot).encode()))
    if committed_at is not None:
        stamp = committed_at.astimezone(UTC).isoformat().replace("+00:00", "Z")
        headers.append(("committed_at", stamp.encode()))
    if change.op == "delete":
        headers.append(("before", _json(change.before)))
        return _json(change.key, canonical=True), None, headers
    before = change.before
    if before is not None and change.row is not None and ERASED in change.row.values():
        # A subject's personal fields were erased (guarantee 27): the record that says so is
        # the one compaction keeps of the row, so its before image must not hold them either.
        before = {c: ERASED if change.row.get(c) == ERASED else v for c, v in before.items()}
    value = _json({"row": change.row, "before": before})
    return _json(change.key, canonical=True), value, headers


def from_record(
    table: str, key: bytes, value: bytes | None, headers: list[tuple[str, bytes]]
) -> Change:
    """The change a `cdc.<table>` record carries (the inverse of `record_for`)."""
    h = {k: v for k, v in headers}
    op: Op = h["op"].decode()  # type: ignore[assignment]
    position = WalPosition.parse(h["position"].decode())
    xid = int(h["xid"]) if "xid" in h else None
    snapshot = Snapshot.parse(h["snapshot"].decode()) if "snapshot" in h else None
    if value is None:
        before = json.loads(h["before"]) if "before" in h else None
        return Change(
            table, "delete", json.loads(key), None, before, position, len(key), xid, snapshot
        )
    body = json.loads(value)
    size = len(key) + len(value)
    row, before = body["row"], body.get("before")
    return Change(table, op, json.loads(key), row, before, position, size, xid, snapshot)
