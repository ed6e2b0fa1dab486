"""The whole log merged into a projection the way the live pipeline merges a batch: for a
rebuild of a projection whose rows combine only in Postgres, or that counts stream records
once (`Projection.replayed`), and for its catch-up batches."""

from __future__ import annotations

from typing import Any

import psycopg
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from config.settings import Settings
from config.topics import Topics
from projections.base import Offsets, Projection
from spark.event_rows import (
    AGGREGATE,
    CURRENT,
    LOG_US,
    POSITION,
    TOPIC,
    arrow_rows,
    keep_ids,
    merge_share,
    merge_staged,
    position,
    rows_json,
    share_of,
    upcast_rows,
)
from spark.sink import unapplied


def replay(
    conn: psycopg.Connection[Any],
    p: Projection,
    events: DataFrame,
    offsets: Offsets,
    suffix: str,
    settings: Settings,
    empty: bool = False,
) -> tuple[Offsets, int, int]:
    """Merge the records of `events` (`every_event` of a batch read, or any frame with its
    columns) after `offsets` into `p`'s tables (+ `suffix`) exactly as the live pipeline does.
    Returns the new offsets, the number of records applied and of late records. The caller
    commits. `empty`: those tables are empty, new ones (see `merge_staged`).

    Made for whole logs (a rebuild): only stream records (counted once by id) travel to Python
    whole; of the events, Spark counts them, their late ones and their offsets, and hands over
    only the rows of those on time (in Arrow batches). Events at an older schema version send
    every record through Python, where they are upcast in their place."""
    topics = Topics(settings.topic_prefix)
    columns = [rows_json(o).alias(o.name) for o in p.outputs]
    reads = frozenset(p.reads(topics, settings.partitions))
    streams = frozenset(topics.stream(s) for s in p.streams)
    of_p = events.where(F.col("topic").isin(*p.topic_names(topics)))
    mine = unapplied(of_p, offsets)
    selected = mine.select(*position(), *columns)
    late = F.lit(False)
    if p.lateness is not None:
        late = F.col("delay_us") > int(p.lateness.total_seconds() * 1e6)
    # A record it cannot tell about goes to Python.
    python = F.coalesce(
        ~F.col("current") | F.col("topic").isin(*streams) | late.isNull(), F.lit(True)
    )
    rows = arrow_rows(selected.where(python))
    if any(r[TOPIC] not in streams for r in rows):
        # An event Python must see (to upcast it, or to tell whether it is late): then every
        # record goes through Python, so that its rows keep their place in the log's order.
        python = F.lit(True)
        rows = arrow_rows(selected)
        if any(not r[CURRENT] for r in rows):
            rows = upcast_rows(mine, rows, columns)
    counted = selected.where(~python)
    passed = {
        f"{r['topic']}:{r['partition']}": (
            int(r["n"]),
            int(r["first"]),
            int(r["last"]),
            int(r["late"]),
        )
        for r in counted.groupBy("topic", "partition")
        .agg(
            F.count("*").alias("n"),
            F.min("offset").alias("first"),
            F.max("offset").alias("last"),
            F.count_if(late).alias("late"),
        )
        .collect()
    }
    share = share_of(p, reads, streams, rows, POSITION, offsets, passed)
    if share is None:
        return offsets, 0, 0
    # Events that add no rows (`[]`) are left out here, not by Spark: a filter on the rows
    # would have Spark work each event's rows out twice (in the filter and in the select).
    handed = [o for o in p.outputs if o.staged is None]
    found = counted.where(~late).select(*(o.name for o in handed)).toArrow()
    for o in handed:  # in log order, as `share_of` lists the rows it is given
        values = found.column(o.name).to_pylist()
        share.rows[o.name] = [v for v in values if v is not None and v != "[]"] + share.rows[o.name]
    # An output that stages its rows gets those of the events Spark counted by COPY (the rows
    # of records Python saw follow as JSON, in `merge_share`).
    on_time = mine.select("*", *position()[LOG_US:AGGREGATE]).where(~python & ~late)
    for o in p.outputs:
        if o.staged is not None:
            merge_staged(conn, settings.database(), o, on_time, suffix, empty, mine)
    late_n = merge_share(conn, p, share, suffix, keep_ids(p, settings))
    return share.after, share.count, late_n
