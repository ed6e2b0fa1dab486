"""`GET /views…`: the read views, with filters, pagination and read-your-writes."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from kafka.errors import KafkaError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.auth import has_scope, narrowed, require, row_scope
from app.errors import ApiError, too_many, unavailable
from app.health import public_lag
from app.read_model import BadValue, BeyondTheLog, ReadModel
from app.waiting import TooManyWaiters
from commands.messages import LogPosition
from projections.base import Fold, View
from projections.registry import VIEWS

bp = Blueprint("views", __name__)

MAX_LIMIT, MAX_WAIT_S = 500, 30.0


def _model() -> ReadModel:
    model: ReadModel = current_app.extensions["logfold.read_model"]
    return model


def _view(name: str) -> tuple[Fold, View]:
    found = VIEWS.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"unknown view {name!r}; GET /views lists them")
    return found


def _forced(output: View) -> dict[str, str]:
    """The filter the token's row claim forces on `output` (403 if it may read none of it)."""
    return row_scope(g.rows, output.name, output.columns)


def query_number(name: str, default: float, low: float, high: float) -> float:
    """The query argument `name` as a number within [low, high] (`422` otherwise)."""
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ApiError(
            422,
            "validation_failed",
            f"invalid {name}",
            [{"field": name, "problem": f"must be a number from {low:g} to {high:g}"}],
        )
    return value


def _lag() -> dict[str, dict[str, Any]]:
    """Each fold's lag: failure texts and data-loss details for `admin` callers only."""
    lag = _model().lag()
    return lag if has_scope("admin") else {name: public_lag(f) for name, f in lag.items()}


def _bad_position(e: Exception, problem: str) -> ApiError:
    return ApiError(
        422, "validation_failed", str(e), [{"field": "consistent_with", "problem": problem}]
    )


def _consistent(projection: Fold) -> None:
    """Wait until the view includes `consistent_with` (query or X-Consistent-With), or 504."""
    token = request.args.get("consistent_with") or request.headers.get("X-Consistent-With")
    if not token:
        return
    try:
        position = LogPosition.parse(token)
    except ValueError as e:
        raise _bad_position(e, "not a position token") from e
    wait = query_number("wait", 5.0, 0.0, MAX_WAIT_S)
    try:
        reached = _model().wait_for(projection, position, wait, g.subject)
    except BeyondTheLog as e:
        raise _bad_position(e, "beyond the end of the log") from e
    except TooManyWaiters as e:
        raise too_many(f"{e}; try again when one has answered") from e
    if not reached:
        lag = _lag().get(projection.name, {})
        raise ApiError(
            504, "timeout", f"the view did not reach the position within {wait:g}s", [{"lag": lag}]
        )


def _unavailable(fn: Any) -> Any:
    """503 with Retry-After when Postgres (the rows) or Kafka (the lag, `consistent_with`'s
    end offsets) does not answer: a dependency is down, the request was fine."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, PoolTimeout, KafkaError) as e:
            which = "Kafka" if isinstance(e, KafkaError) else "Postgres"
            raise unavailable(f"{which} is unavailable; try again", e) from e

    wrapper.__name__ = fn.__name__
    return wrapper


@bp.get("/views")
@require("views:read")
@_unavailable
def list_views() -> Response:
    lag = _lag()
    return jsonify(
        {
            "views": [
                {
                    "name": name,
                    "projection": p.name,
                    "key": list(o.key),
                    "filterable": list(o.filterable),
                    "columns": list(o.columns),
                    "lag": lag.get(p.name),
                }
                for name, (p, o) in VIEWS.items()
            ]
        }
    )


@bp.get("/views/<view>")
@require("views:read")
@_unavailable
def list_rows(view: str) -> Response:
    projection, output = _view(view)
    reserved = {"limit", "cursor", "consistent_with", "wait"}
    filters = {k: v for k, v in request.args.items() if k not in reserved}
    unknown = [k for k in filters if k not in output.filterable]
    if unknown:
        raise ApiError(
            422,
            "validation_failed",
            "unknown filter",
            [
                {"field": k, "problem": f"not filterable; use one of {list(output.filterable)}"}
                for k in unknown
            ],
        )
    filters = narrowed(filters, _forced(output))
    limit = int(query_number("limit", 50, 1, MAX_LIMIT))
    _consistent(projection)
    try:
        rows, next_cursor = _model().rows(output, filters, limit, request.args.get("cursor"))
    except BadValue as e:
        raise ApiError(422, "validation_failed", str(e), [{"problem": str(e)}]) from e
    return jsonify({"rows": rows, "next": next_cursor})


@bp.get("/views/<view>/<path:key>")
@require("views:read")
@_unavailable
def get_row(view: str, key: str) -> Response:
    projection, output = _view(view)
    parts = key.split(",") if len(output.key) > 1 else [key]
    if len(parts) != len(output.key):
        raise ApiError(
            422,
            "validation_failed",
            "wrong key",
            [{"field": "key", "problem": f"give {','.join(output.key)}"}],
        )
    forced = _forced(output)
    _consistent(projection)
    try:
        row = _model().row(output, parts)
    except BadValue as e:
        raise ApiError(422, "validation_failed", str(e), [{"problem": str(e)}]) from e
    if row is None or any(str(row[c]) != v for c, v in forced.items()):
        raise ApiError(404, "not_found", f"no row {key!r} in {view}")  # or not this token's
    return jsonify(row)
