"""Decoding the messages of Postgres's built-in `pgoutput` logical decoding plugin (protocol 1).

Message formats: https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html
Values arrive as text (the types' output functions); `to_python` turns the common types back
into Python values, which `projections.base.wire` then puts in wire form.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

Value = str | None  # text form; None is SQL NULL
UNCHANGED = object()  # an unchanged TOASTed value: not sent, take it from the old row


@dataclass(frozen=True)
class Begin:
    final_lsn: int  # the LSN of the transaction's commit record
    committed_at: datetime
    xid: int


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int  # the position after the commit record: what a consumer confirms
    committed_at: datetime


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class Insert:
    relation: int
    new: tuple[Any, ...]


@dataclass(frozen=True)
class Update:
    relation: int
    old: tuple[Any, ...] | None  # the whole old row with REPLICA IDENTITY FULL
    new: tuple[Any, ...]


@dataclass(frozen=True)
class Delete:
    relation: int
    old: tuple[Any, ...]


@dataclass(frozen=True)
class Truncate:
    relations: tuple[int, ...]


@dataclass(frozen=True)
class Other:
    kind: str  # origin, type, logical message: nothing Logfold acts on


Message = Begin | Commit | Relation | Insert | Update | Delete | Truncate | Other


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def byte(self) -> str:
        value = self.data[self.at : self.at + 1].decode()
        self.at += 1
        return value

    def string(self) -> str:
        end = self.data.index(b"\x00", self.at)
        value = self.data[self.at : end].decode()
        self.at = end + 1
        return value

    def timestamp(self) -> datetime:
        return PG_EPOCH + timedelta(microseconds=self.take("!q"))

    def tuple(self) -> tuple[Any, ...]:
        values: list[Any] = []
        for _ in range(self.take("!h")):
            kind = self.byte()
            if kind == "n":
                values.append(None)
            elif kind == "u":
                values.append(UNCHANGED)
            elif kind == "t":
                size = self.take("!i")
                values.append(self.data[self.at : self.at + size].decode())
                self.at += size
            else:
                raise ValueError(f"unsupported tuple value kind {kind!r} (binary mode is off)")
        return tuple(values)


def decode(payload: bytes) -> Message:
    r = _Reader(payload)
    kind = r.byte()
    if kind == "B":
        return Begin(r.take("!Q"), r.timestamp(), r.take("!I"))
    if kind == "C":
        r.take("!B")  # flags, unused
        return Commit(r.take("!Q"), r.take("!Q"), r.timestamp())
    if kind == "R":
        oid, namespace, name = r.take("!I"), r.string(), r.string()
        r.take("!B")  # replica identity setting
        columns = []
        for _ in range(r.take("!h")):
            r.take("!B")  # flags: part of the replica identity (every column with FULL)
            column_name = r.string()
            type_oid = r.take("!I")
            r.take("!i")  # type modifier
            columns.append(Column(column_name, type_oid))
        return Relation(oid, namespace, name, tuple(columns))
    if kind == "I":
        relation = r.take("!I")
        r.byte()  # 'N'
        return Insert(relation, r.tuple())
    if kind == "U":
        relation = r.take("!I")
        marker = r.byte()
        old = None
        if marker in ("K", "O"):
            old = r.tuple()
            marker = r.byte()
        return Update(relation, old, r.tuple())
    if kind == "D":
        relation = r.take("!I")
        r.byte()  # 'K' or 'O'
        return Delete(relation, r.tuple())
    if kind == "T":
        count = r.take("!I")
        r.take("!B")  # options
        return Truncate(tuple(r.take("!I") for _ in range(count)))
    return Other({"O": "origin", "Y": "type", "M": "message"}.get(kind, kind))


# Type OIDs from pg_type.dat.
_INTEGERS = {20, 21, 23, 26}  # int8, int2, int4, oid
_FLOATS = {700, 701}
_NUMERIC, _BOOL, _JSON, _JSONB, _TIMESTAMP, _TIMESTAMPTZ = 1700, 16, 114, 3802, 1114, 1184


def to_python(type_oid: int, text: str) -> Any:
    """A value's text form as the Python value psycopg would return for it."""
    if type_oid in _INTEGERS:
        return int(text)
    if type_oid in _FLOATS:
        return float(text)
    if type_oid == _NUMERIC:
        return Decimal(text)
    if type_oid == _BOOL:
        return text == "t"
    if type_oid in (_JSON, _JSONB):
        return json.loads(text)
    if type_oid in (_TIMESTAMP, _TIMESTAMPTZ):
        if text in ("infinity", "-infinity"):
            return text
        return datetime.fromisoformat(text)
    return text
