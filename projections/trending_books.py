"""Page views per book in hopping windows of event time: 24 hours long, one starting every hour.

Each page view counts in the 24 windows that contain it (`[window_start, window_end)`, starts on
the hour). A view more than `LATENESS` older than when the API received it is late: counted in
the projection's `late_events`, left out of the windows.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, DateTime, Table, Text
from sqlalchemy import Column as SqlColumn

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from projections.base.rows import Rows

SIZE, ADVANCE = timedelta(hours=24), timedelta(hours=1)
LATENESS = timedelta(hours=2)

table = Table(
    "trending_books",
    metadata,
    SqlColumn("book_id", Text, primary_key=True),
    SqlColumn("window_start", DateTime(timezone=True), primary_key=True),
    SqlColumn("window_end", DateTime(timezone=True), nullable=False),
    SqlColumn("views", BigInteger, nullable=False),
)


def rows() -> Rows:
    """A page view adds one view to each window of its book that contains it."""
    from projections.base.rows import F, each, field, hopping_windows, when_type

    return each(
        table,
        when_type("page_views", hopping_windows(F.col("occurred_at"), SIZE, ADVANCE)),
        lambda start: {
            "book_id": field("book_id"),
            "window_start": F.timestamp_seconds(start),
            "window_end": F.timestamp_seconds(start + int(SIZE.total_seconds())),
            "views": F.lit(1),
        },
    )


windows = Output(
    table,
    rows=rows,
    merge={"views": "sum"},
    filterable=("book_id",),
    version_column=None,
)
projection = Projection(
    "trending_books", topics=(), streams=("page_views",), lateness=LATENESS, outputs=(windows,)
)
