"""What one delivery carries: its id (stable across retries, replays and restarts, so a
receiver that remembers ids applies each change once) and its body."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cdc.changes import Change, WalPosition, seen_as


@dataclass(frozen=True)
class Message:
    id: str  # `webhook-id`
    offset: int  # the change's offset in its changelog
    position: WalPosition
    key: dict[str, Any]
    body: bytes  # exactly what is signed and sent


def message_id(endpoint_id: str, position: WalPosition) -> str:
    """One id per endpoint and change: the change's WAL position names it uniquely among every
    table's changes, and a resend of the change by CDC after a crash carries the same one."""
    return f"msg_{endpoint_id}_{position.lsn}_{position.seq}"


def body(view: str, op: str, change: Change) -> bytes:
    """`{"type": "change", "view", "op", "key", "row", "position"}`: `op` as a subscriber of
    the endpoint's filter sees the change (`cdc.changes.seen_as`), `row` null on a delete."""
    payload = {
        "type": "change",
        "view": view,
        "op": op,
        "key": change.key,
        "row": change.row if op == "upsert" else None,
        "position": str(change.position),
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def message_for(
    endpoint_id: str, view: str, filter: dict[str, Any], change: Change, offset: int
) -> Message | None:
    """The delivery of `change` to an endpoint of `view` with `filter` (column -> value in
    wire form), or None when the change does not concern it."""
    op = seen_as(filter, change)
    if op is None:
        return None
    return Message(
        message_id(endpoint_id, change.position),
        offset,
        change.position,
        change.key,
        body(view, op, change),
    )
