"""How a view's values look on the wire (REST rows, changelog records, websocket messages).

One function, so a row read from Postgres and the same row decoded from the WAL compare equal."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any


def wire_value(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, date):  # a day: ISO, as CDC gives it
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    return value


def wire_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: wire_value(v) for k, v in row.items()}
