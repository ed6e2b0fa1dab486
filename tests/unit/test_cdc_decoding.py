"""pgoutput messages as Postgres sends them, decoded; changelog records round trip."""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from cdc import pgoutput
from cdc.changes import Change, WalPosition, from_record, record_for


def _s(text: str) -> bytes:
    return text.encode() + b"\x00"


def _tuple(*values: str | object | None) -> bytes:
    out = struct.pack("!h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is pgoutput.UNCHANGED:
            out += b"u"
        else:
            data = str(v).encode()
            out += b"t" + struct.pack("!i", len(data)) + data
    return out


MICROS = 1_000_000 * 3600  # 2000-01-01T01:00:00Z


def test_begin_and_commit() -> None:
    begin = pgoutput.decode(b"B" + struct.pack("!QqI", 0x16B3748, MICROS, 742))
    assert begin == pgoutput.Begin(0x16B3748, datetime(2000, 1, 1, 1, tzinfo=UTC), 742)
    commit = pgoutput.decode(b"C" + struct.pack("!BQQq", 0, 0x16B3748, 0x16B3790, MICROS))
    assert commit == pgoutput.Commit(0x16B3748, 0x16B3790, datetime(2000, 1, 1, 1, tzinfo=UTC))


def test_relation() -> None:
    columns = struct.pack("!h", 2) + b"".join(
        struct.pack("!B", 1) + _s(name) + struct.pack("!Ii", oid, -1)
        for name, oid in (("customer_id", 25), ("version", 20))
    )
    message = b"R" + struct.pack("!I", 16401) + _s("public") + _s("customers") + b"f" + columns
    relation = pgoutput.decode(message)
    assert relation == pgoutput.Relation(
        16401,
        "public",
        "customers",
        (pgoutput.Column("customer_id", 25), pgoutput.Column("version", 20)),
    )


def test_insert_update_delete_truncate() -> None:
    rel = struct.pack("!I", 16401)
    assert pgoutput.decode(b"I" + rel + b"N" + _tuple("c1", None)) == pgoutput.Insert(
        16401, ("c1", None)
    )
    update = pgoutput.decode(b"U" + rel + b"O" + _tuple("c1", "1") + b"N" + _tuple("c1", "2"))
    assert update == pgoutput.Update(16401, ("c1", "1"), ("c1", "2"))
    no_old = pgoutput.decode(b"U" + rel + b"N" + _tuple("c1", pgoutput.UNCHANGED))
    assert no_old == pgoutput.Update(16401, None, ("c1", pgoutput.UNCHANGED))
    delete = pgoutput.decode(b"D" + rel + b"O" + _tuple("c1", "2"))
    assert delete == pgoutput.Delete(16401, ("c1", "2"))
    truncate = pgoutput.decode(b"T" + struct.pack("!IBII", 2, 0, 16401, 16402))
    assert truncate == pgoutput.Truncate((16401, 16402))
    assert pgoutput.decode(b"Y" + struct.pack("!I", 1) + _s("s") + _s("t")) == pgoutput.Other(
        "type"
    )


def test_binary_values_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="binary"):
        pgoutput.decode(b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 1) + b"b")


@pytest.mark.parametrize(
    ("oid", "text", "value"),
    [
        (20, "42", 42),
        (23, "-7", -7),
        (701, "0.1", 0.1),
        (1700, "12.50", Decimal("12.50")),
        (16, "t", True),
        (16, "f", False),
        (3802, '{"a": [1]}', {"a": [1]}),
        (1184, "2026-11-21 10:00:00.5+00", datetime(2026, 11, 21, 10, 0, 0, 500000, tzinfo=UTC)),
        (25, "plain text", "plain text"),
    ],
)
def test_values_from_their_text_form(oid: int, text: str, value: object) -> None:
    assert pgoutput.to_python(oid, text) == value


def test_records_round_trip_and_deletes_are_tombstones() -> None:
    at = datetime(2026, 11, 21, 10, tzinfo=UTC)
    upsert = Change(
        "customers",
        "update",
        {"customer_id": "c1"},
        {"customer_id": "c1", "name": "B"},
        {"customer_id": "c1", "name": "A"},
        WalPosition(100, 2),
    )
    key, value, headers = record_for(upsert, at)
    assert key == b'{"customer_id":"c1"}'
    assert dict(headers)["committed_at"] == b"2026-11-21T10:00:00Z"
    assert from_record("customers", key, value, headers) == upsert
    delete = Change(
        "customers",
        "delete",
        {"customer_id": "c1"},
        None,
        {"customer_id": "c1", "name": "B"},
        WalPosition(101, 1),
    )
    key, value, headers = record_for(delete, at)
    assert value is None
    assert from_record("customers", key, value, headers) == delete


def test_positions_order_by_lsn_then_sequence() -> None:
    assert WalPosition(5, 9) < WalPosition(6, 1) < WalPosition(6, 2)
    assert WalPosition.parse(str(WalPosition(123, 4))) == WalPosition(123, 4)
    for bad in ("", "1", "a.b", "1.2.3", "-1.2"):
        with pytest.raises(ValueError):
            WalPosition.parse(bad)
