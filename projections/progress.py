"""How far each projection has folded the log: the last applied offset of every topic-partition,
written in the same transaction as the projection's rows."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Table, Text, func
from sqlalchemy.dialects.postgresql import JSONB

from projections import metadata

table = Table(
    "projection_progress",
    metadata,
    Column("projection", Text, primary_key=True),
    Column("offsets", JSONB, nullable=False, server_default="{}"),
    Column("events_applied", BigInteger, nullable=False, server_default="0"),
    Column("late_events", BigInteger, nullable=False, server_default="0"),
    Column("generation", BigInteger, nullable=False, server_default="0"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
