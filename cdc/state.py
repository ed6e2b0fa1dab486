"""The CDC process's own bookkeeping: which slots finished their first snapshot."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Table, Text, func

from projections import metadata

table = Table(
    "cdc_slots",
    metadata,
    Column("slot", Text, primary_key=True),
    Column("consistent_point", Text, nullable=False),  # the LSN its first snapshot was taken at
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
