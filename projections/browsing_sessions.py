"""Browsing sessions: per customer, page views closer than `GAP` in event time form one session.

A session window has no fixed bounds: a view extends the session it is close to, starts one
when it is close to none, and merges two (or more) when it is close to each (a view that arrives
late, within the watermark, between two sessions). The sessions of a set of views do not depend
on the order they arrive in, so the live view and a rebuild agree. `books` lists the distinct
books viewed in the session. Views later than `LATENESS` are counted in `late_events`, left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, DateTime, Table, Text
from sqlalchemy import Column as SqlColumn
from sqlalchemy.dialects.postgresql import JSONB

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import Column

GAP = timedelta(minutes=30)
LATENESS = timedelta(hours=2)

table = Table(
    "browsing_sessions",
    metadata,
    SqlColumn("customer_id", Text, primary_key=True),
    SqlColumn("session_start", DateTime(timezone=True), primary_key=True),
    SqlColumn("session_end", DateTime(timezone=True), nullable=False),  # its last view
    SqlColumn("views", BigInteger, nullable=False),
    SqlColumn("books", JSONB, nullable=False),  # distinct book ids, sorted
)


def rows() -> Column:
    """A page view: one point (customer, time, book) for the sessions."""
    from projections.base.rows import F, field, when_type

    return when_type(
        "page_views",
        F.array(
            F.struct(
                field("customer_id").alias("customer_id"),
                F.col("occurred_at").alias("at"),
                field("book_id").alias("book_id"),
            )
        ),
    )


@dataclass(frozen=True, kw_only=True)
class SessionWindows(Output):
    """Session windows of points (customer_id, at, book_id), merged in Postgres: a batch's
    points and the stored sessions they could touch are regrouped, and only the sessions that
    changed are written (a merged-away session is deleted)."""

    gap: timedelta

    @property
    def replayed(self) -> bool:
        return True

    def merge_sql(self, target: str, rows: str) -> str:
        gap = f"INTERVAL '{int(self.gap.total_seconds())} seconds'"
        return f"""
WITH points AS (
    SELECT customer_id, at, book_id
    FROM json_to_recordset({rows}::json) AS r (customer_id text, at timestamptz, book_id text)
), span AS (
    SELECT customer_id, min(at) - {gap} AS lo, max(at) + {gap} AS hi
    FROM points GROUP BY customer_id
), touched AS (
    SELECT s.* FROM {target} s JOIN span USING (customer_id)
    WHERE s.session_end > span.lo AND s.session_start < span.hi
), items AS (
    SELECT customer_id, session_start AS s, session_end AS e, views, books FROM touched
    UNION ALL
    SELECT customer_id, at, at, 1, jsonb_build_array(book_id) FROM points
), reached AS (
    SELECT *, max(e) OVER (
        PARTITION BY customer_id ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
    ) AS reach FROM items
), grouped AS (
    SELECT *, count(*) FILTER (WHERE reach IS NULL OR s - reach >= {gap}) OVER (
        PARTITION BY customer_id ORDER BY s, e ROWS UNBOUNDED PRECEDING
    ) AS session FROM reached
), merged AS (
    SELECT g.customer_id, min(g.s) AS session_start, max(g.e) AS session_end,
        sum(g.views)::bigint AS views,
        (SELECT jsonb_agg(DISTINCT b ORDER BY b) FROM grouped o,
            jsonb_array_elements_text(o.books) AS b
         WHERE o.customer_id = g.customer_id AND o.session = g.session) AS books
    FROM grouped g GROUP BY g.customer_id, g.session
), gone AS (
    DELETE FROM {target} t USING touched o
    WHERE t.customer_id = o.customer_id AND t.session_start = o.session_start
    AND NOT EXISTS (
        SELECT 1 FROM merged m
        WHERE m.customer_id = o.customer_id AND m.session_start = o.session_start
    )
)
INSERT INTO {target} AS t (customer_id, session_start, session_end, views, books)
SELECT customer_id, session_start, session_end, views, books FROM merged
ON CONFLICT (customer_id, session_start) DO UPDATE SET
    session_end = excluded.session_end, views = excluded.views, books = excluded.books
WHERE (t.session_end, t.views, t.books)
    IS DISTINCT FROM (excluded.session_end, excluded.views, excluded.books)
"""


sessions = SessionWindows(
    table,
    rows=rows,
    merge={},
    filterable=("customer_id",),
    version_column=None,
    gap=GAP,
)
projection = Projection(
    "browsing_sessions",
    topics=(),
    streams=("page_views",),
    lateness=LATENESS,
    outputs=(sessions,),
)
