"""Rebuilds asked of the running projector, in Postgres (`rebuild_requests`, declared in
`projections/base/progress.py`).

`logfold rebuild` asks; a projector that folds the same versions of every projection named
claims the request and rebuilds in its own Spark driver (`spark/rebuilder.py`), beating while
it works; the command follows the row and prints its reports. A request nobody claims in time
is withdrawn and the command rebuilds in a driver of its own, as does one whose projector
stopped beating: a rebuild swaps each projection in one transaction, so starting it again
loses and doubles nothing."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from projections.base import versions as _versions
from projections.base.declarations import Join, Projection

KEEP_DAYS = 7  # finished requests are deleted after this many days (by the next request)


def versions_of(projections: Iterable[Projection], joins: Iterable[Join]) -> dict[str, str]:
    """Name -> version of what a folder folds (the asking code's, or the projector's)."""
    return {p.name: _versions.of(p) for p in projections} | {
        j.name: _versions.of_join(j) for j in joins
    }


@dataclass(frozen=True)
class Request:
    id: int
    versions: dict[str, str]  # projection or join -> the version the asking code folds
    verify: bool


@dataclass(frozen=True)
class State:
    """Where a request is: unclaimed, or claimed (with its beat's age), and finished."""

    claimed_by: str | None
    beat_age_s: float | None
    done: int | None
    total: int | None
    finished: bool
    reports: list[dict[str, Any]] | None
    error: str | None


def ask(conn: psycopg.Connection[Any], versions: dict[str, str], verify: bool) -> int:
    """A new request for `versions`' projections; its id."""
    conn.execute(
        "DELETE FROM rebuild_requests WHERE finished_at < now() - make_interval(days => %s)",
        (KEEP_DAYS,),
    )
    row = conn.execute(
        "INSERT INTO rebuild_requests (projections, verify) VALUES (%s, %s) RETURNING id",
        (Jsonb(versions), verify),
    ).fetchone()
    assert row is not None
    return int(row[0])


def withdraw(conn: psycopg.Connection[Any], request: int) -> bool:
    """Delete `request` unless it was claimed meanwhile; whether it was withdrawn."""
    cur = conn.execute(
        "DELETE FROM rebuild_requests WHERE id = %s AND claimed_by IS NULL", (request,)
    )
    return cur.rowcount == 1


def claim(conn: psycopg.Connection[Any], mine: dict[str, str], who: str) -> Request | None:
    """The oldest unclaimed request whose every projection this folder folds at the version
    asked (`mine`: name -> version), claimed by `who`; None when there is none."""
    with conn.transaction():
        rows = conn.execute(
            "SELECT id, projections, verify FROM rebuild_requests WHERE claimed_by IS NULL "
            "ORDER BY id FOR UPDATE SKIP LOCKED"
        ).fetchall()
        for id_, versions, verify in rows:
            if all(mine.get(name) == version for name, version in versions.items()):
                conn.execute(
                    "UPDATE rebuild_requests SET claimed_by = %s, beat_at = now() WHERE id = %s",
                    (who, id_),
                )
                return Request(int(id_), dict(versions), bool(verify))
    return None


def beat(conn: psycopg.Connection[Any], request: int, done: int | None, total: int | None) -> None:
    conn.execute(
        "UPDATE rebuild_requests SET beat_at = now(), done = %s, total = %s WHERE id = %s",
        (done, total, request),
    )


def finish(
    conn: psycopg.Connection[Any],
    request: int,
    reports: list[dict[str, Any]] | None = None,
    error: str | None = None,
) -> None:
    """Record the reports of a request carried out, or the error that stopped it."""
    conn.execute(
        "UPDATE rebuild_requests SET finished_at = now(), beat_at = now(), reports = %s, "
        "error = %s WHERE id = %s",
        (
            None if reports is None else Jsonb(json.loads(json.dumps(reports, default=str))),
            error,
            request,
        ),
    )


def state(conn: psycopg.Connection[Any], request: int) -> State | None:
    """Where `request` is; None when it is gone."""
    row = conn.execute(
        "SELECT claimed_by, extract(epoch FROM now() - beat_at), done, total, "
        "finished_at IS NOT NULL, reports, error FROM rebuild_requests WHERE id = %s",
        (request,),
    ).fetchone()
    if row is None:
        return None
    claimed_by, age, done, total, finished, reports, error = row
    return State(
        claimed_by,
        None if age is None else float(age),
        done,
        total,
        bool(finished),
        reports,
        error,
    )


@dataclass(frozen=True)
class Asked:
    """A request not finished yet, as `logfold projections` lists it."""

    id: int
    versions: dict[str, str]
    claimed_by: str | None
    beat_age_s: float | None
    done: int | None
    total: int | None


def unfinished(conn: psycopg.Connection[Any]) -> list[Asked]:
    rows = conn.execute(
        "SELECT id, projections, claimed_by, extract(epoch FROM now() - beat_at), done, total "
        "FROM rebuild_requests WHERE finished_at IS NULL ORDER BY id"
    ).fetchall()
    return [
        Asked(int(r[0]), dict(r[1]), r[2], None if r[3] is None else float(r[3]), r[4], r[5])
        for r in rows
    ]


def projector_beat_age(conn: psycopg.Connection[Any]) -> float | None:
    """Seconds since the projector last wrote its status (spark/status.py); None without one."""
    row = conn.execute(
        "SELECT extract(epoch FROM now() - beat_at) FROM projector_status WHERE name = 'projector'"
    ).fetchone()
    return None if row is None else float(row[0])
