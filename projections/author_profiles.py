"""Author profiles: a plain table, written with SQL outside the event log (no projection folds
it). CDC captures it like the views, so joins can use it (see author_pages).

Its history: a trigger (migration 0010) appends every version of a profile to
`author_profile_history`, valid from the moment it was written (`clock_timestamp()`), and a
deleted profile as a version without an account. A temporal join reads the profile *as it was*
at an event's time from there (see royalty_payouts): the compacted changelog keeps only each
profile's latest row, and a rebuild must find the same version the live view found."""

from __future__ import annotations

from sqlalchemy import Boolean, Column, DateTime, Table, Text, func

from projections import metadata

table = Table(
    "author_profiles",
    metadata,
    Column("author", Text, primary_key=True),
    Column("bio", Text),
    Column("website", Text),
    Column("updated_at", DateTime(timezone=True), server_default=func.now()),
    Column("payout_account", Text),  # where the author's royalties are paid
)

history = Table(
    "author_profile_history",
    metadata,
    Column("author", Text, primary_key=True),
    Column("valid_from", DateTime(timezone=True), primary_key=True),
    Column("payout_account", Text),
    Column("deleted", Boolean, nullable=False, server_default="false"),
)

plain_tables = (table,)
