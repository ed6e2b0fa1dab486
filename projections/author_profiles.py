"""Author profiles: a plain table, written with SQL outside the event log (no projection folds
it). CDC captures it like the views, so joins can use it (see author_pages)."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Table, Text, func

from projections import metadata

table = Table(
    "author_profiles",
    metadata,
    Column("author", Text, primary_key=True),
    Column("bio", Text),
    Column("website", Text),
    Column("updated_at", DateTime(timezone=True), server_default=func.now()),
)

plain_tables = (table,)
