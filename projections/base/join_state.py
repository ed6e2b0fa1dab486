"""What the joins keep of their input tables: per join, side and key, the last row seen (NULL once
deleted, so a resent older insert cannot bring it back) and the changelog position it came
from, which only ever moves forward. Written by `spark/join.py` in the same transaction as the
joined rows and the join's progress."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, Table, Text
from sqlalchemy.dialects.postgresql import JSONB

from projections import metadata
from projections.base import JOIN_STATE

table = Table(
    JOIN_STATE,
    metadata,
    Column("join_name", Text, primary_key=True),
    Column("side", Text, primary_key=True),  # left | right
    Column("key", JSONB, primary_key=True),  # the source row's primary key
    Column("join_value", Text),  # the row's join column as text; NULL when deleted or null
    Column("row", JSONB),  # in wire form; NULL: deleted
    Column("lsn", BigInteger, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Index("ix_join_state_join_value", "join_name", "side", "join_value"),
)
