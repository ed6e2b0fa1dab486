"""`/dead-letters…` (scope `admin`): the projections' parked events (guarantee 26) — list them,
and ask for a retry (once a fold is fixed) or a skip (on purpose, recorded). The projector
carries retries and skips out (`spark/parking.py`); the API only marks what is asked for, which
is all its login may write of them (migration 0015). `logfold dead-letters` does the same."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Blueprint, Response, current_app, jsonify, request

from app.auth import require
from app.errors import ApiError, database_unavailable, json_object
from config.settings import Settings
from projections.base import dead_letters as store
from projections.registry import PROJECTIONS

bp = Blueprint("dead_letters", __name__)

MAX_LIMIT = 500
MAX_REASON = 500
MAX_AGGREGATE = 500


def _connect() -> psycopg.Connection[Any]:
    settings: Settings = current_app.extensions["logfold.settings"]
    return psycopg.connect(settings.api_database(), connect_timeout=5)


def _projection(name: str) -> str:
    if name not in PROJECTIONS:
        raise ApiError(
            404, "not_found", f"unknown projection {name!r}; GET /dead-letters lists them"
        )
    return name


def _invalid(field: str, problem: str) -> ApiError:
    return ApiError(422, "validation_failed", problem, [{"field": field, "problem": problem}])


def _text(body: dict[str, Any], field: str, limit: int, required: bool) -> str | None:
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > limit or "\x00" in value:
        raise _invalid(field, f"a non-empty string of at most {limit} characters")
    return value


def _body(allowed: set[str]) -> dict[str, Any]:
    body = json_object() if request.get_data() else {}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _invalid(unknown[0], f"unknown field; allowed: {', '.join(sorted(allowed))}")
    return body


@bp.get("/dead-letters")
@require("admin")
@database_unavailable
def summary() -> Response:
    """Every projection's parked and skipped events at a glance."""
    with _connect() as conn:
        found = store.summaries(conn)
    return jsonify(
        {
            "projections": [
                {
                    "projection": name,
                    "parked_events": (s := found.get(name, store.Summary())).parked_events,
                    "parked_aggregates": s.parked_aggregates,
                    "skipped_events": s.skipped_events,
                    "first_error": s.first_error,
                }
                for name in PROJECTIONS
            ]
        }
    )


@bp.get("/dead-letters/<projection>")
@require("admin")
@database_unavailable
def events(projection: str) -> Response:
    """A projection's parked (or, `?skipped=true`, skipped) events in log order."""
    _projection(projection)
    aggregate = request.args.get("aggregate")
    skipped = request.args.get("skipped", "false")
    if skipped not in ("true", "false"):
        raise _invalid("skipped", "true or false")
    raw = request.args.get("limit", "100")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise _invalid("limit", f"an integer from 1 to {MAX_LIMIT}")
    table = "skipped_events" if skipped == "true" else "parked_events"
    with _connect() as conn:
        found = store.letters(conn, projection, aggregate, int(raw), table=table)
    return jsonify({"projection": projection, "events": [f.shown() for f in found]})


@bp.post("/dead-letters/<projection>/retry")
@require("admin")
@database_unavailable
def retry(projection: str) -> tuple[Response, int]:
    """Ask the projector to apply the parked events again, in order (of one aggregate, or
    all): `202`, then `GET /dead-letters/<projection>` shows them go."""
    _projection(projection)
    body = _body({"aggregate"})
    aggregate = _text(body, "aggregate", MAX_AGGREGATE, required=False)
    with _connect() as conn:
        asked = store.request_retry(conn, projection, aggregate)
    if not asked:
        raise ApiError(404, "not_found", f"nothing of {aggregate or projection!r} is parked")
    return jsonify({"projection": projection, "retry_requested": asked}), 202


@bp.post("/dead-letters/<projection>/skip")
@require("admin")
@database_unavailable
def skip(projection: str) -> tuple[Response, int]:
    """Ask the projector to skip, on record, an aggregate's parked event that failed (with
    `every`: all of its parked events) and retry the rest: `202`."""
    _projection(projection)
    body = _body({"aggregate", "reason", "every"})
    aggregate = _text(body, "aggregate", MAX_AGGREGATE, required=True)
    reason = _text(body, "reason", MAX_REASON, required=True)
    every = body.get("every", False)
    if not isinstance(every, bool):
        raise _invalid("every", "true or false")
    assert aggregate is not None and reason is not None
    with _connect() as conn:
        asked = store.request_skip(conn, projection, aggregate, reason, every)
    if not asked:
        raise ApiError(404, "not_found", f"nothing of {aggregate!r} is parked in {projection}")
    return jsonify({"projection": projection, "skip_requested": asked}), 202
