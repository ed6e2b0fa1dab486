"""Earlier versions of a projection, kept for a quick rollback (guarantee 25).

When a build swaps another version of a projection in (`spark/deploy.py`, or `logfold rebuild`
run by changed code), the version it replaces is kept first: a copy of each of its tables (its
outputs and their state, and for a stream view the record ids it counted) taken in one
snapshot while it served, so at one position of the log, recorded in `kept_versions`.

Deploying that version again (rolling back) starts from the copy: its shadows are filled from
it and folded forward from its position, by the events since, instead of from the whole log;
then swapped as any build is. The copy must still be what a fold of the log up to its position
gives: it is not kept while events of its version are parked (the swap clears them), and not
used once an event was skipped since (a rebuild leaves skipped events out; the copy has them).

`LOGFOLD_KEEP_VERSIONS` versions are kept per projection (the newest; 0 keeps none). Each costs
the disk of its tables. The copies are plain tables no reader is granted."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from projections.base import Offsets

log = logging.getLogger(__name__)

KEPT = "__kept_"


def copy_stream_ids(conn: psycopg.Connection[Any], source: str, target: str) -> None:
    """Add the ids `source` counted to those of `target` (a kept copy's, a shadow's)."""
    conn.execute(
        "INSERT INTO stream_ids (fold, id, first_at) "
        "SELECT %s, id, first_at FROM stream_ids WHERE fold = %s",
        (target, source),
    )


@dataclass(frozen=True)
class Kept:
    projection: str
    version: str
    offsets: Offsets
    tables: dict[str, str]  # live table -> its copy
    skipped_events: int
    kept_at: datetime


def stream_fold(projection: str, version: str) -> str:
    """The fold name a kept stream view's counted record ids are stored under."""
    return f"{projection}{KEPT}{_digest(version)}"


def _digest(version: str) -> str:
    return hashlib.sha256(version.encode()).hexdigest()[:10]


def _copy_name(table: str, version: str) -> str:
    return f"{table[: 63 - len(KEPT) - 10]}{KEPT}{_digest(version)}"


def keep(url: str, projection: str, tables: list[str], streams: bool) -> Kept | None:
    """Copy `projection`'s live `tables` at one position (one snapshot, while the live
    projector goes on) and record them as its live version, kept. None when there is nothing
    to keep: no version recorded, or events of it parked (said in the log)."""
    with psycopg.connect(url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            # The first statement takes the snapshot every copy below reads.
            row = conn.execute(
                "SELECT version, offsets FROM projection_progress WHERE projection = %s",
                (projection,),
            ).fetchone()
            if row is None or row[0] is None:
                return None
            version, offsets = str(row[0]), dict(row[1])
            parked, skipped = (
                _count(conn, table, projection) for table in ("parked_events", "skipped_events")
            )
            if parked:
                log.warning(
                    "projection %s: version %s is not kept for a rollback: %d of its events "
                    "are parked",
                    projection,
                    version,
                    parked,
                )
                return None
            _drop(conn, projection, version)
            copies = {t: _copy_name(t, version) for t in tables}
            for table, copy in copies.items():
                conn.execute(f"CREATE TABLE {copy} AS TABLE {table}")
            if streams:
                copy_stream_ids(conn, projection, stream_fold(projection, version))
            kept_at = conn.execute(
                "INSERT INTO kept_versions (projection, version, offsets, tables, skipped_events) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING kept_at",
                (projection, version, Jsonb(offsets), Jsonb(copies), skipped),
            ).fetchone()
    assert kept_at is not None
    return Kept(projection, version, offsets, copies, skipped, kept_at[0])


def _count(conn: psycopg.Connection[Any], table: str, projection: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table} WHERE projection = %s", (projection,))
    return int(row.fetchone()[0])  # type: ignore[index]


def kept(conn: psycopg.Connection[Any], projection: str | None = None) -> list[Kept]:
    """The kept versions (of `projection`), newest first."""
    rows = conn.execute(
        "SELECT projection, version, offsets, tables, skipped_events, kept_at FROM kept_versions "
        "WHERE %s::text IS NULL OR projection = %s ORDER BY projection, kept_at DESC",
        (projection, projection),
    ).fetchall()
    return [Kept(p, v, dict(o), dict(t), int(s), at) for p, v, o, t, s, at in rows]


def usable(conn: psycopg.Connection[Any], projection: str, version: str) -> Kept | None:
    """`projection`'s kept `version`, if a build can start from it: its tables are all there
    and no event was skipped since it was kept."""
    found = [k for k in kept(conn, projection) if k.version == version]
    if not found:
        return None
    copy = found[0]
    if _count(conn, "skipped_events", projection) != copy.skipped_events:
        log.warning(
            "projection %s: kept version %s is not used: events were skipped since it was kept",
            projection,
            version,
        )
        return None
    for table in copy.tables.values():
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() in (None, (None,)):
            return None
    return copy


def prune(conn: psycopg.Connection[Any], projection: str, keeping: int) -> list[str]:
    """Drop what is kept of `projection` beyond its newest `keeping` versions, and of its live
    version (built again: its copy is stale). Returns the versions dropped."""
    row = conn.execute(
        "SELECT version FROM projection_progress WHERE projection = %s", (projection,)
    ).fetchone()
    live = row[0] if row else None
    others = [k for k in kept(conn, projection) if k.version != live]
    dropped = [k.version for k in kept(conn, projection) if k.version == live]
    dropped += [k.version for k in others[keeping:]]
    for version in dropped:
        _drop(conn, projection, version)
    return dropped


def _drop(conn: psycopg.Connection[Any], projection: str, version: str) -> None:
    row = conn.execute(
        "DELETE FROM kept_versions WHERE projection = %s AND version = %s RETURNING tables",
        (projection, version),
    ).fetchone()
    for copy in dict(row[0]).values() if row else ():
        conn.execute(f"DROP TABLE IF EXISTS {copy}")
    conn.execute("DELETE FROM stream_ids WHERE fold = %s", (stream_fold(projection, version),))
