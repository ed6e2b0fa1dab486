"""Subscribing to a view, whatever carries the messages: a websocket (`/ws`), server-sent events
(`/views/<view>/events`) or long-polling (`/views/<view>/changes`). All three make the same
promise (guarantees 12 and 22), so they share this: checking the view and the filter against
the token's row claim, waiting for `consistent_with`, and starting from a consistent snapshot or
from a position the hub's history still holds (a `resync` otherwise). What goes wrong is a
`Problem`, which each protocol says in its own way (`http_error` for the HTTP ones)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import KafkaError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.auth import narrowed, row_scope
from app.errors import ApiError
from app.health import public_lag
from app.hub import Client, Hub, Subscription, Unservable, compact
from app.read_model import BadValue, BeyondTheLog, ReadModel
from app.waiting import TooManyWaiters
from app.ws_messages import Problem
from cdc.changes import Snapshot, WalPosition
from commands.messages import LogPosition
from config.settings import Settings
from projections.base import Fold, View
from projections.registry import VIEWS

log = logging.getLogger(__name__)

HUB_WAIT_S = 15.0

# The HTTP status of each problem a subscription can meet (server-sent events, long-polling).
STATUS = {
    "validation_failed": 422,
    "too_many_rows": 422,
    "not_found": 404,
    "forbidden": 403,
    "unauthorized": 401,
    "too_many_requests": 429,
    "unavailable": 503,
    "timeout": 504,
}


@dataclass
class Reader:
    """Who subscribes: the token's subject, scopes and row claim (guarantee 18)."""

    subject: str
    scopes: set[str] = field(default_factory=set)
    rows: dict[str, str] = field(default_factory=dict)


def parse_since(raw: str, sub_id: str | None = None) -> WalPosition | Snapshot:
    """A change's position, or a snapshot's (`xmin:xmax:xip…`, when nothing came after it)."""
    try:
        return Snapshot.parse(raw) if ":" in raw else WalPosition.parse(raw)
    except ValueError as e:
        raise Problem("validation_failed", f"since: {e}", sub_id) from e


def http_error(p: Problem) -> ApiError:
    """A subscription's problem as an HTTP answer (4xx/5xx with the usual JSON body)."""
    details = [{"problem": p.message, **p.details}] if p.details else None
    status = STATUS.get(p.code, 422)
    headers = (
        {"Retry-After": str(p.details.get("retry_after", 1))} if status in (429, 503) else None
    )
    return ApiError(status, p.code, p.message, details, headers=headers)


class Subscriber:
    """A reader's means to subscribe to views through one `Client` (its outbox)."""

    def __init__(
        self, settings: Settings, hub: Hub, model: ReadModel, client: Client, reader: Reader
    ) -> None:
        self.settings, self.hub, self.model = settings, hub, model
        self.client, self.reader = client, reader

    def subscription(self, sub_id: str, view: str, filter: dict[str, Any]) -> Subscription:
        """A subscription of `view` for `filter` (within the token's row claim; values checked
        against their columns); not started."""
        found = VIEWS.get(view)
        if found is None:
            raise Problem("not_found", f"unknown view {view!r}; GET /views lists them", sub_id)
        projection, output = found
        allowed = set(output.filterable) | set(output.key)
        unknown = sorted(set(filter) - allowed)
        if unknown:
            raise Problem(
                "validation_failed",
                f"cannot filter {view} on {unknown}; filterable: {sorted(allowed)}",
                sub_id,
            )
        try:  # the token's row claim: the filter may narrow it, never widen it
            claimed = narrowed(filter, row_scope(self.reader.rows, view, output.columns))
        except ApiError as e:
            raise Problem(e.code, e.message, sub_id) from e
        try:
            wanted = self.model.filter_values(output, claimed)
        except BadValue as e:
            raise Problem("validation_failed", str(e), sub_id) from e
        return Subscription(sub_id, view, output.name, projection.name, wanted, self.client)

    def wait_for(self, sub: Subscription, consistent_with: str, wait: float) -> None:
        """Wait until the view includes the command position `consistent_with` (the bound of
        REST's `?consistent_with=&wait=`); a `timeout` problem with the lag if it does not."""
        fold: Fold = VIEWS[sub.view][0]
        try:
            written = LogPosition.parse(consistent_with)
        except ValueError as e:
            raise Problem("validation_failed", f"consistent_with: {e}", sub.id) from e
        try:
            if self.model.wait_for(fold, written, wait, self.reader.subject):
                return
            lag = self.model.lag().get(fold.name, {})
            if "admin" not in self.reader.scopes:  # failure texts and lost ranges: admin only
                lag = public_lag(lag)
        except (OperationalError, PoolTimeout) as e:
            raise Problem("unavailable", "the database is unavailable; retry", sub.id) from e
        except BeyondTheLog as e:
            raise Problem("validation_failed", f"consistent_with: {e}", sub.id) from e
        except TooManyWaiters as e:
            raise Problem(
                "too_many_requests", f"{e}; try again when one has answered", sub.id
            ) from e
        except KafkaError as e:  # the log's end offsets, for a view fed by changelogs
            log.warning("consistent_with on %s: Kafka did not answer (%s)", sub.view, e)
            raise Problem("unavailable", "Kafka is unavailable; retry", sub.id) from e
        raise Problem(
            "timeout", f"{sub.view} did not reach the position within {wait:g}s", sub.id, lag=lag
        )

    def ready(self, sub_id: str | None) -> None:
        """The hub has read the changelogs (at start, once): it can tell what is missing."""
        self.hub.start()
        if not self.hub.ready.wait(HUB_WAIT_S):
            raise Problem("unavailable", "the changelogs are not readable yet; retry", sub_id)

    def start(self, sub: Subscription, since: WalPosition | Snapshot | None) -> None:
        """Stream to `sub` what it does not have: the changes after `since` when the hub's
        history holds them, else (a `resync` first, when `since` was given) a snapshot."""
        self.ready(sub.id)
        if since is not None:
            try:
                self.hub.subscribe(sub, since)
                return
            except Unservable:
                self.client.offer({"type": "resync", "id": sub.id})
        self.snapshot(sub)

    def snapshot(self, sub: Subscription) -> None:
        """Queue a snapshot of `sub`'s rows, then stream the changes it does not see."""
        output: View = VIEWS[sub.view][1]
        limit = self.settings.ws_snapshot_rows
        for _ in range(3):
            rows, snapshot, weight = self.rows(sub, output, limit)
            first = {"type": "snapshot", "id": sub.id, "rows": rows, "position": str(snapshot)}
            try:
                self.hub.subscribe(sub, snapshot, first, weight)
                return
            except Unservable:
                continue  # the hub's history moved past the snapshot meanwhile: take another
        raise Problem("unavailable", "could not take a consistent snapshot; retry", sub.id)

    def rows(
        self, sub: Subscription, output: View, limit: int
    ) -> tuple[list[dict[str, Any]], Snapshot, int]:
        """`sub`'s rows, the snapshot they were read in and their weight in bytes; refused when
        there are more than `limit` or they weigh more than a connection may queue."""
        try:
            rows, snapshot = self.model.snapshot(output, sub.filter, limit)
        except (OperationalError, PoolTimeout) as e:
            raise Problem("unavailable", "the database is unavailable; retry", sub.id) from e
        if len(rows) > limit:
            raise Problem(
                "too_many_rows",
                f"the snapshot would exceed {limit} rows; narrow the filter",
                sub.id,
            )
        weight = len(compact(rows))
        if weight > self.settings.ws_buffer_bytes // 2:
            raise Problem(
                "too_many_rows",
                f"the snapshot would be {weight} bytes, more than a connection may queue "
                "(LOGFOLD_WS_BUFFER_BYTES / 2); narrow the filter",
                sub.id,
            )
        return rows, snapshot, weight
