"""The projections' dead letters in Postgres (guarantee 26; the tables are in
`projections/base/progress.py`): what the live pipeline parks, what `logfold dead-letters` and
`/dead-letters` list, retry and skip.

A projection's aggregate is parked while it has rows in `parked_events`: the event its fold
could not apply and every later one of the same aggregate (for a stream, of the same key), in
log order. Everything that changes them for a projection runs holding its progress row
(`lock`), as the live pipeline's transactions do, so a batch never sees half a retry or a skip.
A retry is carried out by the projector (it needs Spark to fold): a request marks the rows,
the projector applies them in order, in bounded chunks, each chunk's rows and the removal of
its letters in one transaction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

MAX_ERROR_CHARS = 2000
Key = tuple[str, str]  # (topic, aggregate)


@dataclass(frozen=True)
class Letter:
    """One parked (or skipped) event of a projection."""

    projection: str
    topic: str
    partition: int
    offset: int
    aggregate: str
    error: str
    parked_at: datetime
    retry_requested_at: datetime | None = None
    reason: str | None = None  # of a skip: asked for (parked), or done (skipped)

    def shown(self) -> dict[str, Any]:
        return {
            "projection": self.projection,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "aggregate": self.aggregate,
            "error": self.error,
            "parked_at": self.parked_at.isoformat(),
            "retry_requested": self.retry_requested_at is not None,
            "skip_reason": self.reason,
        }


@dataclass(frozen=True)
class Summary:
    """A projection's dead letters at a glance (`/health`, `/metrics`, `GET /views`)."""

    parked_events: int = 0
    parked_aggregates: int = 0
    skipped_events: int = 0
    first_error: str | None = None  # of the oldest parked event that failed itself


LETTER = 'projection, topic, partition, "offset", aggregate, error, parked_at'


def lock(conn: psycopg.Connection[Any], projection: str) -> bool:
    """Hold `projection`'s progress row until the transaction ends (live batches wait); whether
    it exists."""
    row = conn.execute(
        "SELECT 1 FROM projection_progress WHERE projection = %s FOR UPDATE", (projection,)
    ).fetchone()
    return row is not None


def parked_keys(conn: psycopg.Connection[Any], projections: Iterable[str]) -> dict[str, set[Key]]:
    """Per projection, the aggregates it has parked."""
    found: dict[str, set[Key]] = {}
    for name, topic, aggregate in conn.execute(
        "SELECT DISTINCT projection, topic, aggregate FROM parked_events "
        "WHERE projection = ANY(%s)",
        (list(projections),),
    ):
        found.setdefault(name, set()).add((topic, aggregate))
    return found


def park(
    conn: psycopg.Connection[Any],
    projection: str,
    letters: Iterable[tuple[str, int, int, str, str]],
) -> int:
    """Park events of `projection`: (topic, partition, offset, aggregate, error) each. An event
    parked already stays as it is."""
    rows = [(projection, t, p, o, a, e[:MAX_ERROR_CHARS]) for t, p, o, a, e in letters]
    if not rows:
        return 0
    with conn.cursor() as cur:
        cur.executemany(
            'INSERT INTO parked_events (projection, topic, partition, "offset", aggregate, error) '
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            rows,
        )
    return len(rows)


def summaries(conn: psycopg.Connection[Any]) -> dict[str, Summary]:
    """Every projection's dead letters that has any."""
    found: dict[str, dict[str, Any]] = {}
    for name, events, aggregates in conn.execute(
        "SELECT projection, count(*), count(DISTINCT (topic, aggregate)) FROM parked_events "
        "GROUP BY projection"
    ):
        found.setdefault(name, {}).update(parked_events=events, parked_aggregates=aggregates)
    for name, error in conn.execute(
        "SELECT DISTINCT ON (projection) projection, error FROM parked_events "
        "WHERE error NOT LIKE 'behind %%' ORDER BY projection, parked_at, \"offset\""
    ):
        found.setdefault(name, {})["first_error"] = error
    for name, events in conn.execute(
        "SELECT projection, count(*) FROM skipped_events GROUP BY projection"
    ):
        found.setdefault(name, {})["skipped_events"] = events
    return {name: Summary(**fields) for name, fields in found.items()}


def letters(
    conn: psycopg.Connection[Any],
    projection: str | None = None,
    aggregate: str | None = None,
    limit: int = 100,
    after: tuple[str, int, int] | None = None,
    table: str = "parked_events",
) -> list[Letter]:
    """Parked (or skipped: `table`) events in log order per aggregate, at most `limit`, after
    (topic, partition, offset) `after` (paging)."""
    assert table in ("parked_events", "skipped_events")
    more = ", retry_requested_at, skip_reason" if table == "parked_events" else ", NULL, reason"
    where: list[str] = ["TRUE"]
    args: list[Any] = []
    if projection is not None:
        where.append("projection = %s")
        args.append(projection)
    if aggregate is not None:
        where.append("aggregate = %s")
        args.append(aggregate)
    if after is not None:
        where.append('(topic, partition, "offset") > (%s, %s, %s)')
        args += list(after)
    rows = conn.execute(
        f"SELECT {LETTER}{more} FROM {table} WHERE {' AND '.join(where)} "
        f'ORDER BY projection, topic, partition, "offset" LIMIT %s',
        (*args, limit),
    ).fetchall()
    return [Letter(*r) for r in rows]


def request_retry(
    conn: psycopg.Connection[Any], projection: str, aggregate: str | None = None
) -> int:
    """Ask the projector to apply `projection`'s parked events again (of `aggregate`, or
    all); returns how many are asked for."""
    cur = conn.execute(
        "UPDATE parked_events SET retry_requested_at = now() "
        "WHERE projection = %s AND (%s::text IS NULL OR aggregate = %s)",
        (projection, aggregate, aggregate),
    )
    return cur.rowcount


def request_skip(
    conn: psycopg.Connection[Any], projection: str, aggregate: str, reason: str, every: bool = False
) -> int:
    """Ask for `aggregate`'s first parked event of `projection` (the one its fold could not
    apply; `every`: all of its parked events) to be skipped, for `reason`; returns how many
    (`carry_out_skips` does it, in the projector or at once: `skip`)."""
    cur = conn.execute(
        "UPDATE parked_events SET skip_reason = %s WHERE projection = %s AND aggregate = %s "
        'AND (%s OR (topic, partition, "offset") = ('
        '  SELECT topic, partition, "offset" FROM parked_events '
        "  WHERE projection = %s AND aggregate = %s "
        '  ORDER BY topic, partition, "offset" LIMIT 1))',
        (reason, projection, aggregate, every, projection, aggregate),
    )
    return cur.rowcount


def carry_out_skips(conn: psycopg.Connection[Any], projection: str) -> list[Letter]:
    """Skip, on record, `projection`'s parked events a skip was asked for (`request_skip`), and
    ask for a retry of what is parked behind them. Holds the projection's progress row."""
    if not lock(conn, projection):
        return []
    rows = conn.execute(
        f"SELECT {LETTER}, skip_reason FROM parked_events "
        "WHERE projection = %s AND skip_reason IS NOT NULL "
        'ORDER BY topic, partition, "offset" FOR UPDATE',
        (projection,),
    ).fetchall()
    chosen = [Letter(*r[:7]) for r in rows]
    with conn.cursor() as cur:
        cur.executemany(
            'INSERT INTO skipped_events (projection, topic, partition, "offset", aggregate, '
            "error, parked_at, reason) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING",
            [
                (
                    s.projection,
                    s.topic,
                    s.partition,
                    s.offset,
                    s.aggregate,
                    s.error,
                    s.parked_at,
                    r[7],
                )
                for s, r in zip(chosen, rows, strict=True)
            ],
        )
    unpark(conn, chosen)
    for aggregate in sorted({s.aggregate for s in chosen}):
        request_retry(conn, projection, aggregate)  # what is parked behind them
    return chosen


def skip(
    conn: psycopg.Connection[Any],
    projection: str,
    aggregate: str,
    reason: str,
    every: bool = False,
) -> list[Letter]:
    """Skip at once, on purpose and on record, `aggregate`'s first parked event of `projection`
    (`every`: all of them), and ask for a retry of the rest: `request_skip`, then
    `carry_out_skips`, in one transaction. Returns what was skipped."""
    with conn.transaction():
        request_skip(conn, projection, aggregate, reason, every)
        return carry_out_skips(conn, projection)


def skip_requests(conn: psycopg.Connection[Any], projections: Iterable[str]) -> list[str]:
    """The projections with a skip asked for."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT projection FROM parked_events "
            "WHERE skip_reason IS NOT NULL AND projection = ANY(%s) ORDER BY 1",
            (list(projections),),
        )
    ]


def retry_requests(
    conn: psycopg.Connection[Any], projections: Iterable[str]
) -> list[tuple[str, Key]]:
    """The aggregates whose retry is asked for: (projection, (topic, aggregate))."""
    return [
        (name, (topic, aggregate))
        for name, topic, aggregate in conn.execute(
            "SELECT DISTINCT projection, topic, aggregate FROM parked_events "
            "WHERE retry_requested_at IS NOT NULL AND projection = ANY(%s) ORDER BY 1, 2, 3",
            (list(projections),),
        )
    ]


def first_parked(
    conn: psycopg.Connection[Any], projection: str, key: Key, limit: int, lock_rows: bool = False
) -> list[Letter]:
    """The first `limit` parked events of one aggregate, in log order."""
    rows = conn.execute(
        f"SELECT {LETTER}, retry_requested_at FROM parked_events "
        "WHERE projection = %s AND topic = %s AND aggregate = %s "
        f'ORDER BY partition, "offset" LIMIT %s{" FOR UPDATE" if lock_rows else ""}',
        (projection, *key, limit),
    ).fetchall()
    return [Letter(*r) for r in rows]


def unpark(conn: psycopg.Connection[Any], letters: Iterable[Letter]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            "DELETE FROM parked_events WHERE projection = %s AND topic = %s AND partition = %s "
            'AND "offset" = %s',
            [(s.projection, s.topic, s.partition, s.offset) for s in letters],
        )


def retry_failed(
    conn: psycopg.Connection[Any], projection: str, key: Key, letter: Letter, error: str
) -> None:
    """A retry of `key` stopped at `letter`, which failed again with `error`: it keeps that
    error, and the aggregate waits for the next request."""
    conn.execute(
        "UPDATE parked_events SET error = %s WHERE projection = %s AND topic = %s "
        'AND partition = %s AND "offset" = %s',
        (error[:MAX_ERROR_CHARS], projection, letter.topic, letter.partition, letter.offset),
    )
    conn.execute(
        "UPDATE parked_events SET retry_requested_at = NULL "
        "WHERE projection = %s AND topic = %s AND aggregate = %s",
        (projection, *key),
    )
