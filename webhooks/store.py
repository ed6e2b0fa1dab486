"""The endpoints and their dead letters in Postgres (`webhooks/tables.py`): what the API
registers, pauses, resumes, deletes and replays, and what the dispatcher's workers read and
move (cursors, failures, dead letters).

Every change the API makes is followed by a `NOTIFY` on CHANNEL, so the dispatcher acts on it
at once rather than at its next look (`LOGFOLD_WEBHOOK_POLL_S`). A worker holds its endpoint
through a `Session`: one connection holding the endpoint's advisory lock, through which it
also moves the cursor, so a worker whose connection (and so its lock) is gone cannot move it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from webhooks.messages import Message

CHANNEL = "logfold_webhooks"
CONNECT_TIMEOUT_S = 5
LOCK_NAMESPACE = "logfold.webhook:"


@dataclass(frozen=True)
class Endpoint:
    id: str
    url: str
    view: str
    filter: dict[str, Any]
    secret: str
    status: str
    paused_reason: str | None
    cursor: int
    last_position: str | None
    failing_since: datetime | None
    retrying_offset: int | None
    retrying_since: datetime | None
    attempts: int
    last_error: str | None
    skipped_offsets: int
    created_at: datetime
    updated_at: datetime
    dead_letters: int = 0  # failed ones (listings only)

    @property
    def active(self) -> bool:
        return self.status == "active"


@dataclass(frozen=True)
class DeadLetter:
    message_id: str
    endpoint_id: str
    offset: int
    position: str
    key: dict[str, Any]
    body: str
    attempts: int
    last_error: str
    first_attempt_at: datetime
    failed_at: datetime
    status: str
    replayed_at: datetime | None


class Gone(Exception):
    """The endpoint was deleted, or is no longer active, under its worker."""


COLUMNS = (
    "id, url, view, filter, secret, status, paused_reason, cursor, last_position, "
    "failing_since, retrying_offset, retrying_since, attempts, last_error, skipped_offsets, "
    "created_at, updated_at"
)
FAILED_COUNT = (
    "(SELECT count(*) FROM webhook_dead_letters d "
    "WHERE d.endpoint_id = e.id AND d.status = 'failed') AS dead_letters"
)


def new_id() -> str:
    return "ep_" + secrets.token_hex(12)


def _connect(url: str) -> psycopg.Connection[dict[str, Any]]:
    return psycopg.connect(
        url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, row_factory=dict_row
    )


class WebhookStore:
    """The API's and the dispatcher's access to the tables: a connection per call (the API's
    calls are rare and administrative; nothing to pool or to close)."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with _connect(self.url) as conn:
            yield conn

    def create(
        self, url: str, view: str, filter: dict[str, Any], secret: str, cursor: int
    ) -> Endpoint:
        with self._conn() as conn, conn.transaction():
            row = conn.execute(
                f"INSERT INTO webhook_endpoints (id, url, view, filter, secret, cursor) "
                f"VALUES (%s, %s, %s, %s, %s, %s) RETURNING {COLUMNS}",
                (new_id(), url, view, json.dumps(filter), secret, cursor),
            ).fetchone()
            assert row is not None
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, row["id"]))
        return Endpoint(**row)

    def all(self) -> list[Endpoint]:
        with self._conn() as conn:
            rows = conn.execute(
                f"SELECT {COLUMNS}, {FAILED_COUNT} FROM webhook_endpoints e ORDER BY created_at, id"
            ).fetchall()
        return [Endpoint(**r) for r in rows]

    def get(self, endpoint_id: str) -> Endpoint | None:
        with self._conn() as conn:
            row = conn.execute(
                f"SELECT {COLUMNS}, {FAILED_COUNT} FROM webhook_endpoints e WHERE id = %s",
                (endpoint_id,),
            ).fetchone()
        return None if row is None else Endpoint(**row)

    def pause(self, endpoint_id: str, reason: str) -> bool:
        with self._conn() as conn, conn.transaction():
            done = conn.execute(
                "UPDATE webhook_endpoints SET status = 'paused', paused_reason = %s, "
                "updated_at = now() WHERE id = %s",
                (reason, endpoint_id),
            ).rowcount
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, endpoint_id))
        return done == 1

    def resume(self, endpoint_id: str) -> bool:
        """Active again, from its cursor, with a fresh retry window and failure clock."""
        with self._conn() as conn, conn.transaction():
            done = conn.execute(
                "UPDATE webhook_endpoints SET status = 'active', paused_reason = NULL, "
                "failing_since = NULL, retrying_offset = NULL, retrying_since = NULL, "
                "attempts = 0, updated_at = now() WHERE id = %s",
                (endpoint_id,),
            ).rowcount
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, endpoint_id))
        return done == 1

    def delete(self, endpoint_id: str) -> bool:
        with self._conn() as conn, conn.transaction():
            done = conn.execute(
                "DELETE FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
            ).rowcount
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, endpoint_id))
        return done == 1

    def dead_letters(
        self, endpoint_id: str, status: str | None, limit: int, after: int | None = None
    ) -> list[DeadLetter]:
        """An endpoint's dead letters in changelog order, from after offset `after`."""
        with self._conn() as conn:
            rows = conn.execute(
                'SELECT message_id, endpoint_id, "offset", position, key, body, attempts, '
                "last_error, first_attempt_at, failed_at, status, replayed_at "
                "FROM webhook_dead_letters WHERE endpoint_id = %s "
                "AND (%s::text IS NULL OR status = %s) "
                'AND (%s::bigint IS NULL OR "offset" > %s) ORDER BY "offset" LIMIT %s',
                (endpoint_id, status, status, after, after, limit),
            ).fetchall()
        return [DeadLetter(**r) for r in rows]

    def replay(self, endpoint_id: str, message_ids: list[str] | None) -> int:
        """Mark failed dead letters (all, or those named) for the endpoint's worker to deliver
        again; how many were marked."""
        with self._conn() as conn, conn.transaction():
            done = conn.execute(
                "UPDATE webhook_dead_letters SET status = 'replaying' "
                "WHERE endpoint_id = %s AND status = 'failed' "
                "AND (%s::text[] IS NULL OR message_id = ANY(%s::text[]))",
                (endpoint_id, message_ids, message_ids),
            ).rowcount
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, endpoint_id))
        return done

    # The dispatcher's side.

    def active(self) -> list[Endpoint]:
        with self._conn() as conn:
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM webhook_endpoints WHERE status = 'active' ORDER BY id"
            ).fetchall()
        return [Endpoint(**r) for r in rows]

    def replaying(self) -> set[str]:
        """Endpoints with dead letters waiting to be replayed."""
        with self._conn() as conn:
            rows = conn.execute(
                "SELECT DISTINCT endpoint_id FROM webhook_dead_letters WHERE status = 'replaying'"
            ).fetchall()
        return {r["endpoint_id"] for r in rows}

    @contextmanager
    def listening(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """A connection that LISTENs on CHANNEL (its `notifies()` wake the dispatcher)."""
        with _connect(self.url) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            yield conn

    @contextmanager
    def session(self, endpoint_id: str) -> Iterator[Session | None]:
        """The endpoint held by this process (its advisory lock, on a connection of its own),
        or None when another worker holds it."""
        with _connect(self.url) as conn:
            key = LOCK_NAMESPACE + endpoint_id
            row = conn.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0)) AS held", (key,)
            ).fetchone()
            if row is None or not row["held"]:
                yield None
                return
            try:
                yield Session(conn, endpoint_id)
            finally:
                if not conn.closed:
                    conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (key,))


class Session:
    """One worker's hold on its endpoint: every write checks the endpoint is still there (and
    active, where it matters), and raises Gone when it is not."""

    def __init__(self, conn: psycopg.Connection[dict[str, Any]], endpoint_id: str) -> None:
        self.conn, self.id = conn, endpoint_id

    def load(self) -> Endpoint | None:
        row = self.conn.execute(
            f"SELECT {COLUMNS} FROM webhook_endpoints WHERE id = %s", (self.id,)
        ).fetchone()
        return None if row is None else Endpoint(**row)

    def ensure_active(self) -> None:
        """Gone unless the endpoint is still there and active: checked before every attempt,
        so none starts once a pause or a delete is committed (one already under way ends)."""
        row = self.conn.execute(
            "SELECT status FROM webhook_endpoints WHERE id = %s", (self.id,)
        ).fetchone()
        if row is None or row["status"] != "active":
            raise Gone(self.id)

    def _update(self, sql: str, params: tuple[Any, ...]) -> None:
        if self.conn.execute(sql, params).rowcount != 1:
            raise Gone(self.id)

    def advance(self, cursor: int, position: str | None, skipped: int = 0) -> None:
        """The cursor past what was delivered, dead-lettered or did not concern the endpoint;
        the failures of the delivery it passes are forgotten."""
        self._update(
            "UPDATE webhook_endpoints SET cursor = %s, "
            "last_position = coalesce(%s, last_position), "
            "skipped_offsets = skipped_offsets + %s, retrying_offset = NULL, "
            "retrying_since = NULL, attempts = 0 WHERE id = %s",
            (cursor, position, skipped, self.id),
        )

    def delivered(self) -> None:
        """A success: the endpoint is not failing (any more)."""
        self._update(
            "UPDATE webhook_endpoints SET failing_since = NULL, last_error = NULL WHERE id = %s",
            (self.id,),
        )

    def failed(self, offset: int | None, since: datetime, attempts: int, error: str) -> float:
        """A failed attempt at the delivery of `offset` (None: a replay), retried since
        `since`; returns how long the endpoint has been failing, in seconds (by the database's
        clock, the one that stamped its first failure)."""
        row = self.conn.execute(
            "UPDATE webhook_endpoints SET failing_since = coalesce(failing_since, now()), "
            "retrying_offset = coalesce(%s, retrying_offset), "
            "retrying_since = CASE WHEN %s::bigint IS NULL THEN retrying_since ELSE %s END, "
            "attempts = CASE WHEN %s::bigint IS NULL THEN attempts ELSE %s END, "
            "last_error = %s WHERE id = %s "
            "RETURNING extract(epoch FROM now() - failing_since)::float8 AS failing_for",
            (offset, offset, since, offset, attempts, error, self.id),
        ).fetchone()
        if row is None:
            raise Gone(self.id)
        return float(row["failing_for"])

    def dead_letter(
        self, message: Message, attempts: int, error: str, first_attempt_at: datetime
    ) -> None:
        """The delivery kept as a dead letter, and the cursor past it, at once."""
        with self.conn.transaction():
            self.conn.execute(
                'INSERT INTO webhook_dead_letters (message_id, endpoint_id, "offset", '
                "position, key, body, attempts, last_error, first_attempt_at, failed_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now()) "
                "ON CONFLICT (message_id) DO UPDATE SET status = 'failed', "
                "attempts = webhook_dead_letters.attempts + excluded.attempts, "
                "last_error = excluded.last_error, failed_at = now()",
                (
                    message.id,
                    self.id,
                    message.offset,
                    str(message.position),
                    json.dumps(message.key),
                    message.body.decode(),
                    attempts,
                    error,
                    first_attempt_at,
                ),
            )
            self.advance(message.offset + 1, str(message.position))

    def pause(self, reason: str) -> None:
        self.conn.execute(
            "UPDATE webhook_endpoints SET status = 'paused', paused_reason = %s, "
            "updated_at = now() WHERE id = %s AND status = 'active'",
            (reason, self.id),
        )

    def replays(self) -> list[DeadLetter]:
        rows = self.conn.execute(
            'SELECT message_id, endpoint_id, "offset", position, key, body, attempts, '
            "last_error, first_attempt_at, failed_at, status, replayed_at "
            "FROM webhook_dead_letters WHERE endpoint_id = %s AND status = 'replaying' "
            'ORDER BY "offset"',
            (self.id,),
        ).fetchall()
        return [DeadLetter(**r) for r in rows]

    def replayed(self, message_id: str, delivered: bool, attempts: int, error: str | None) -> None:
        self.conn.execute(
            "UPDATE webhook_dead_letters SET status = %s, attempts = attempts + %s, "
            "last_error = coalesce(%s, last_error), "
            "replayed_at = CASE WHEN %s THEN now() ELSE replayed_at END, "
            "failed_at = CASE WHEN %s THEN failed_at ELSE now() END "
            "WHERE message_id = %s",
            (
                "delivered" if delivered else "failed",
                attempts,
                error,
                delivered,
                delivered,
                message_id,
            ),
        )
