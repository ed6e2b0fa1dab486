"""Reading the views: rows, pagination, progress and lag, and waiting for a position."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from kafka import KafkaConsumer, TopicPartition

from cdc.capture import slot_name
from commands.messages import Position
from projections.base import Join, Output, Projection
from projections.progress import table as progress_table
from projections.registry import JOINS, PROJECTIONS
from projections.wire import wire_row, wire_value
from stack.migrate import sqlalchemy_url
from stack.settings import Settings
from stack.topics import Topics


def _poll(check: Callable[[], bool], deadline: float) -> bool:
    """Whether `check()` became true before `deadline` (time.monotonic), polling every 50 ms."""
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class BadValue(ValueError):
    """A filter, key or cursor value that does not fit its column."""


def coerce(column: sa.Column[Any], value: Any) -> Any:
    """`value` (text from a URL or a cursor) as the column's Python type, or BadValue."""
    kind = column.type.python_type
    try:
        if kind is datetime:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        if kind is int and isinstance(value, str) and not value.lstrip("-").isdigit():
            raise ValueError(value)
        result = kind(value)
        if isinstance(result, str) and "\x00" in result:
            raise ValueError(value)  # Postgres text cannot hold NUL
        return result
    except (TypeError, ValueError) as e:
        raise BadValue(f"{value!r} is not a valid {column.name}") from e


def encode_cursor(values: list[Any]) -> str:
    raw = json.dumps([v.isoformat() if isinstance(v, datetime) else v for v in values])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, size: int) -> list[Any]:
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except Exception as e:
        raise BadValue("not a cursor from a previous page") from e
    if not isinstance(values, list) or len(values) != size:
        raise BadValue("not a cursor from a previous page")
    return values


def jsonable(row: sa.Row[Any]) -> dict[str, Any]:
    return wire_row(dict(row._mapping))


class ReadModel:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.engine = sa.create_engine(
            sqlalchemy_url(settings.database()),
            pool_size=10,
            max_overflow=20,
            pool_pre_ping=True,
            pool_timeout=5,
            connect_args={"connect_timeout": 3, "options": "-c statement_timeout=10000"},
        )
        self._ends: tuple[float, dict[str, int]] = (0.0, {})
        self._lock = threading.Lock()

    def rows(
        self, output: Output, filters: dict[str, str], limit: int, cursor: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        t = output.table
        key = [t.c[k] for k in output.key]
        query = sa.select(t).order_by(*key).limit(limit + 1)
        for column, value in filters.items():
            query = query.where(t.c[column] == coerce(t.c[column], value))
        if cursor is not None:
            after = decode_cursor(cursor, len(key))
            values = [coerce(k, v) for k, v in zip(key, after, strict=True)]
            query = query.where(sa.tuple_(*key) > sa.tuple_(*values))
        with self.engine.connect() as conn:
            found = conn.execute(query).fetchall()
        page = [jsonable(r) for r in found[:limit]]
        more = len(found) > limit
        next_cursor = (
            encode_cursor([found[limit - 1]._mapping[k] for k in output.key]) if more else None
        )
        return page, next_cursor

    def row(self, output: Output, key: list[str]) -> dict[str, Any] | None:
        t = output.table
        query = sa.select(t)
        for name, value in zip(output.key, key, strict=True):
            query = query.where(t.c[name] == coerce(t.c[name], value))
        with self.engine.connect() as conn:
            found = conn.execute(query).first()
        return jsonable(found) if found else None

    def filter_values(self, output: Output, filters: dict[str, Any]) -> dict[str, Any]:
        """Filter values checked against their columns, in wire form (as rows carry them)."""
        t = output.table
        return {c: None if v is None else wire_value(coerce(t.c[c], v)) for c, v in filters.items()}

    def snapshot(
        self, output: Output, filters: dict[str, Any], limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """The rows matching `filters` (at most limit + 1) and the WAL position they are exact
        at: the table is share-locked (writers wait a moment, readers do not) so every
        transaction that wrote it before the position is visible and none after."""
        t = output.table
        query = sa.select(t).order_by(*(t.c[k] for k in output.key)).limit(limit + 1)
        for column, value in filters.items():
            c = t.c[column]
            query = query.where(c.is_(None) if value is None else c == coerce(c, value))
        with self.engine.begin() as conn:
            conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
            conn.execute(sa.text(f"LOCK TABLE {t.name} IN SHARE MODE"))
            lsn = conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()::text")).scalar_one()
            found = conn.execute(query).fetchall()
        high, _, low = lsn.partition("/")
        return [jsonable(r) for r in found], (int(high, 16) << 32) | int(low, 16)

    def progress(self) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(progress_table)).fetchall()
        return {r.projection: dict(r._mapping) for r in rows}

    def includes(self, projection: Projection, position: Position) -> bool:
        """Whether the projection has applied the event at `position` (or never will need to)."""
        if position.topic not in {self.topics.events(t) for t in projection.topics}:
            return True
        applied = self.progress().get(projection.name, {}).get("offsets", {})
        return int(applied.get(f"{position.topic}:{position.partition}", -1)) >= position.offset

    def wait_for(self, projection: Projection, position: Position, timeout: float) -> bool:
        """Wait until the view includes the event at `position`; False after `timeout` s."""
        deadline = time.monotonic() + timeout
        join = JOINS.get(projection.name)
        if join is None:
            return _poll(lambda: self.includes(projection, position), deadline)
        return self._join_includes(join, position, deadline)

    def _join_includes(self, join: Join, position: Position, deadline: float) -> bool:
        """A joined view reads changelogs, not events, so it includes an event once (1) the
        projections writing its input tables from the event's topic have applied it, (2) CDC
        has confirmed the WAL up to a position taken after that (Kafka holds every change
        committed before it) and (3) the join has applied its changelogs up to their ends as
        they were then."""
        sources = [
            p
            for p in PROJECTIONS.values()
            if any(o.name in join.tables for o in p.outputs)
            and position.topic in {self.topics.events(t) for t in p.topics}
        ]
        if not sources:
            return True
        if not _poll(lambda: all(self.includes(p, position) for p in sources), deadline):
            return False
        with self.engine.connect() as conn:
            wal = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        if not _poll(lambda: self._cdc_confirmed(wal), deadline):
            return False
        topics = [self.topics.cdc(t) for t in join.tables]
        ends = self._end_offsets([TopicPartition(t, 0) for t in topics])

        def applied() -> bool:
            done = self.progress().get(join.name, {}).get("offsets", {})
            return all(int(done.get(k, -1)) >= end - 1 for k, end in ends.items())

        return _poll(applied, deadline)

    def _cdc_confirmed(self, wal: str) -> bool:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT confirmed_flush_lsn >= CAST(:wal AS pg_lsn) FROM pg_replication_slots "
                    "WHERE slot_name = :slot"
                ),
                {"wal": wal, "slot": slot_name(self.settings)},
            ).scalar()
        return bool(found)

    def end_offsets(self) -> dict[str, int]:
        """End offsets of every events partition and of the joins' changelogs, cached for a
        second."""
        with self._lock:
            at, ends = self._ends
            if time.monotonic() - at < 1.0:
                return ends
            tps = [
                TopicPartition(self.topics.events(a), p)
                for a in {t for proj in PROJECTIONS.values() for t in proj.topics}
                for p in range(self.settings.partitions)
            ] + [
                TopicPartition(self.topics.cdc(t), 0)
                for t in {t for join in JOINS.values() for t in join.tables}
            ]
            ends = self._end_offsets(tps)
            self._ends = (time.monotonic(), ends)
            return ends

    def _end_offsets(self, partitions: list[TopicPartition]) -> dict[str, int]:
        """The current end offsets of `partitions`, as "topic:partition" -> offset."""
        consumer = KafkaConsumer(
            bootstrap_servers=self.settings.kafka(),
            isolation_level="read_committed",
            request_timeout_ms=3000,
        )
        try:
            found = consumer.end_offsets(partitions)
        finally:
            consumer.close()
        return {f"{tp.topic}:{tp.partition}": int(o) for tp, o in found.items()}

    def lag(self) -> dict[str, dict[str, Any]]:
        """Per projection and join: events (for a join: changelog records) not yet applied,
        seconds behind, late events seen, generation.

        Offsets count transaction markers too, so while behind the event count is an upper
        bound; caught up, it is exactly 0 (the last marker after the last event is skipped)."""
        ends, progress = self.end_offsets(), self.progress()
        now = datetime.now(UTC)
        # How far each reader is behind its partitions: a projection's event partitions count
        # transaction markers; a join's changelogs (one partition each) have none.
        behind: dict[str, int] = {}
        for name, projection in PROJECTIONS.items():
            applied = progress.get(name, {}).get("offsets", {})
            behind[name] = 0
            for topic in projection.topics:
                for part in range(self.settings.partitions):
                    k = f"{self.topics.events(topic)}:{part}"
                    last = int(applied.get(k, -1))
                    behind[name] += max(ends.get(k, 0) - last - (2 if last >= 0 else 1), 0)
        for name, join in JOINS.items():
            applied = progress.get(name, {}).get("offsets", {})
            keys = [f"{self.topics.cdc(table)}:0" for table in join.tables]
            behind[name] = sum(max(ends.get(k, 0) - int(applied.get(k, -1)) - 1, 0) for k in keys)
        out = {}
        for name, events in behind.items():
            p = progress.get(name, {})
            updated = p.get("updated_at")
            seconds = (now - updated).total_seconds() if events and updated else 0.0
            out[name] = {
                "events": events,
                "seconds": round(seconds, 3),
                "late_events": int(p.get("late_events", 0)),
                "generation": int(p.get("generation", 0)),
            }
        return out
