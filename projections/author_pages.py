"""An author's page: royalties from the event log (author_royalties) joined with the profile
edited by hand (the plain table author_profiles), kept current from both changelogs."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Table, Text

from projections import metadata
from projections.base import Join, Side

table = Table(
    "author_pages",
    metadata,
    Column("author", Text, primary_key=True),
    Column("bio", Text),
    Column("website", Text),
    Column("royalty_cents", BigInteger),
    Column("units_sold", BigInteger),
)

join = Join(
    table,
    left=Side("author_royalties", key=("author",), on="author"),
    right=Side("author_profiles", key=("author",), on="author"),
    sources={
        "author": ("left", "author"),
        "bio": ("right", "bio"),
        "website": ("right", "website"),
        "royalty_cents": ("left", "royalty_cents"),
        "units_sold": ("left", "units_sold"),
    },
    filterable=("author",),
)
