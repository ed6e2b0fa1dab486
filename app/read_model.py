"""Reading the views: rows, pagination, progress and lag, and waiting for a position."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import UTC, date, datetime
from typing import Any

import sqlalchemy as sa
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from app.waiting import ProgressSignal, SlotWatch, Waiters, poll_until
from cdc.changes import Snapshot
from commands.messages import LogPosition
from config.settings import Settings, kafka_consumer_options, slot_name, sqlalchemy_url
from config.topics import Topics, partition_of
from projections.base import Fold, Projection, View
from projections.base.dead_letters import Summary, summaries
from projections.base.progress import table as progress_table
from projections.base.wire import wire_row, wire_value
from projections.registry import FOLDS, writers

log = logging.getLogger(__name__)


class BadValue(ValueError):
    """A filter, key or cursor value that does not fit its column."""


class BeyondTheLog(ValueError):
    """A position no command was given: past its partition's end offset, or of a partition the
    topic does not have. Waiting for it could only time out."""


BIGINT = 2**63  # Postgres' integers are at most 64 bits


def coerce(column: sa.Column[Any], value: Any) -> Any:
    """`value` (text from a URL, a cursor or a websocket filter) as the column's Python type,
    or BadValue. A time is also one every layer can hold: in UTC (rows and changes carry it
    so), within Python's years 1 to 9999."""
    kind = column.type.python_type
    try:
        if kind is datetime:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
        if kind is date:
            return date.fromisoformat(str(value))
        if kind is int:
            if isinstance(value, bool) or (
                isinstance(value, str) and not value.lstrip("-").isdigit()
            ):
                raise ValueError(value)
            number = int(value)
            if not -BIGINT <= number < BIGINT:
                raise ValueError(value)
            return number
        result = kind(value)
        if isinstance(result, str) and "\x00" in result:
            raise ValueError(value)  # Postgres text cannot hold NUL
        return result
    except (TypeError, ValueError, OverflowError) as e:
        raise BadValue(f"{value!r} is not a valid {column.name}") from e


def encode_cursor(values: list[Any]) -> str:
    """The key of a page's last row, in wire form (a time or a day as ISO text), opaque."""
    raw = json.dumps([wire_value(v) for v in values])
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
            sqlalchemy_url(settings.api_database()),
            pool_size=10,
            max_overflow=20,
            pool_pre_ping=True,
            pool_timeout=5,
            connect_args={"connect_timeout": 3, "options": "-c statement_timeout=10000"},
        )
        self._ends: tuple[float, dict[str, int]] = (0.0, {})
        self._lock = threading.Lock()
        # Kept (a new client per call was costly): read_committed's ends are the last stable
        # offsets, what folds can apply; read_uncommitted's the high watermarks.
        self._offsets: KafkaConsumer | None = None
        self._marks: KafkaConsumer | None = None
        self.signal = ProgressSignal(settings.api_database())
        self.waiters = Waiters(settings.max_waiters, settings.max_waiters_per_subject)
        self.slot = SlotWatch(self._slot_confirmed)

    def rows(
        self, output: View, filters: dict[str, str], limit: int, cursor: str | None
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

    def row(self, output: View, key: list[str]) -> dict[str, Any] | None:
        t = output.table
        query = sa.select(t)
        for name, value in zip(output.key, key, strict=True):
            query = query.where(t.c[name] == coerce(t.c[name], value))
        with self.engine.connect() as conn:
            found = conn.execute(query).first()
        return jsonable(found) if found else None

    def filter_values(self, output: View, filters: dict[str, Any]) -> dict[str, Any]:
        """Filter values checked against their columns, in wire form (as rows carry them)."""
        t = output.table
        return {c: None if v is None else wire_value(coerce(t.c[c], v)) for c, v in filters.items()}

    def snapshot(
        self, output: View, filters: dict[str, Any], limit: int
    ) -> tuple[list[dict[str, Any]], Snapshot]:
        """The rows matching `filters` (at most limit + 1) and the MVCC snapshot they were read
        in: one REPEATABLE READ transaction, so the rows hold exactly the changes of the
        transactions it sees. Nothing is locked: writers go on (the websocket stream hands
        off by transaction, see app/hub.py)."""
        t = output.table
        query = sa.select(t).order_by(*(t.c[k] for k in output.key)).limit(limit + 1)
        for column, value in filters.items():
            c = t.c[column]
            query = query.where(c.is_(None) if value is None else c == coerce(c, value))
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                conn.execute(sa.text("SET TRANSACTION READ ONLY"))
                # The first query takes the transaction's snapshot; the rows use the same.
                seen = conn.execute(sa.text("SELECT pg_current_snapshot()::text")).scalar_one()
                found = conn.execute(query).fetchall()
        return [jsonable(r) for r in found], Snapshot.parse(seen)

    def progress(self) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(progress_table)).fetchall()
        return {r.projection: dict(r._mapping) for r in rows}

    def dead_letters(self) -> dict[str, Summary]:
        """Each projection's parked and skipped events (guarantee 26), where it has any."""
        with self.engine.connect() as conn:
            raw = conn.connection.driver_connection  # psycopg's: the store's queries
            return summaries(raw)  # type: ignore[arg-type]

    def projector_status(self) -> dict[str, Any] | None:
        """The projector's last status (spark/status.py) and its age in seconds by the
        database's clock (the projector's own), or None when no projector runs."""
        query = sa.text(
            "SELECT *, extract(epoch FROM now() - beat_at)::float AS age_s "
            "FROM projector_status WHERE name = 'projector'"
        )
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return dict(row._mapping) if row is not None else None

    def counted(self, fold: Fold) -> dict[str, int]:
        """The figures `fold`'s views declare (`View.counted`): rows meeting each condition."""
        found = {}
        with self.engine.connect() as conn:
            for view in fold.views:
                for label, condition in view.counted.items():
                    query = f"SELECT count(*) FROM {view.name} WHERE {condition}"
                    found[label] = int(conn.execute(sa.text(query)).scalar_one())
        return found

    def includes(self, fold: Fold, position: LogPosition) -> bool:
        """Whether `fold` has applied the record at `position`, if it reads its partition."""
        key = f"{position.topic}:{position.partition}"
        applied = self.progress().get(fold.name, {}).get("offsets", {})
        return int(applied.get(key, -1)) >= position.offset

    def reads(self, fold: Fold, position: LogPosition) -> bool:
        """Whether `fold` reads the partition of `position`."""
        key = f"{position.topic}:{position.partition}"
        return key in fold.reads(self.topics, self.settings.partitions)

    def wait_for(
        self, fold: Fold, position: LogPosition, timeout: float, subject: str = "-"
    ) -> bool:
        """Wait until the view includes the event at `position`; False after `timeout` s.
        Raises BeyondTheLog at once for a position past the log's end, TooManyWaiters when
        `subject` (or the process) has as many waits under way as it may."""
        self.check(position)
        with self.waiters.held(subject):
            return self._wait(fold, position, time.monotonic() + timeout)

    def check(self, position: LogPosition) -> None:
        """BeyondTheLog unless `position` is in its partition's log (for a topic a fold reads;
        any other the read side has nothing to wait for)."""
        key = f"{position.topic}:{position.partition}"
        ends = self.end_offsets()
        if key not in ends:
            if any(k.rsplit(":", 1)[0] == position.topic for k in ends):
                raise BeyondTheLog(f"{position.topic} has no partition {position.partition}")
            return
        if position.offset < ends[key]:
            return
        # The cached end may be a second old, and it is the last stable offset, which a
        # command's transaction passes only once its commit markers are written, after its `201`
        # (on a cluster, a few ms later; the wait is for that). A position is beyond the log only
        # past what the log holds, committed or not: its high watermark.
        with self._lock:
            end = self._end_offsets([partition_of(key)], committed=False)[key]
        if position.offset >= end:
            raise BeyondTheLog(
                f"the position is beyond the end of the log ({key} ends at offset {end}): "
                "no command was given it; use the `position` of a command's response"
            )

    def _wait(self, fold: Fold, position: LogPosition, deadline: float) -> bool:
        """A fold that reads the event's partition includes it once its progress passed it. A
        fold that reads changelogs includes it once (1) the folds writing its input tables
        include it, (2) CDC has confirmed the WAL up to a position taken after that (Kafka holds
        every change committed before it) and (3) it has applied its changelogs up to their
        ends as they were then. A fold that depends on neither never needs to wait."""
        if self.reads(fold, position):
            return poll_until(lambda: self.includes(fold, position), deadline, self.signal)
        feeders = [w for w in writers(fold) if self._depends(w, position)]
        if not feeders:
            return True
        if not all(self._wait(w, position, deadline) for w in feeders):
            return False
        with self.engine.connect() as conn:
            wal = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        if not self.slot.wait(wal, deadline):
            return False
        reads = fold.reads(self.topics, self.settings.partitions)
        with self._lock:
            ends = self._end_offsets([partition_of(k) for k in reads])

        def applied() -> bool:
            done = self.progress().get(fold.name, {}).get("offsets", {})
            return all(int(done.get(k, -1)) >= end - 1 for k, end in ends.items())

        return poll_until(applied, deadline, self.signal)

    def _depends(self, fold: Fold, position: LogPosition) -> bool:
        """Whether the event at `position` can change what `fold` writes."""
        return self.reads(fold, position) or any(self._depends(w, position) for w in writers(fold))

    def _slot_confirmed(self) -> str | None:
        """The CDC slot's confirmed WAL position (None while there is no slot)."""
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = :slot"
                ),
                {"slot": slot_name(self.settings)},
            ).scalar()
        return None if found is None else str(found)

    def end_offsets(self) -> dict[str, int]:
        """End offsets of every partition a fold reads, cached for a second."""
        with self._lock:
            at, ends = self._ends
            if time.monotonic() - at < 1.0:
                return ends
            n = self.settings.partitions
            keys = {k for fold in FOLDS.values() for k in fold.reads(self.topics, n)}
            ends = self._end_offsets([partition_of(k) for k in sorted(keys)])
            self._ends = (time.monotonic(), ends)
            return ends

    def _end_offsets(
        self, partitions: list[TopicPartition], committed: bool = True
    ) -> dict[str, int]:
        """The current end offsets of `partitions`, as "topic:partition" -> offset (under
        `_lock`): the last stable offsets, or with `committed=False` the high watermarks. The
        clients are kept between calls, and dropped after a failure; a failed call is tried once
        more on a new client (a broker may have closed the kept one's connection). Whatever the
        client raises comes out as a KafkaError, which callers answer with `503`: kafka-python
        lets other errors out too (a KeyError for a partition whose answer was lost with its
        connection)."""
        for attempt in (1, 2):
            client = self._offsets if committed else self._marks
            if client is None:
                client = KafkaConsumer(
                    bootstrap_servers=self.settings.kafka(),
                    metrics_enabled=False,
                    isolation_level="read_committed" if committed else "read_uncommitted",
                    request_timeout_ms=3000,
                    **kafka_consumer_options(),
                )
                if committed:
                    self._offsets = client
                else:
                    self._marks = client
            try:
                found = client.end_offsets(partitions)
                return {f"{tp.topic}:{tp.partition}": int(o) for tp, o in found.items()}
            except Exception as e:
                self.close_offsets()
                if attempt == 2:
                    if isinstance(e, KafkaError):
                        raise
                    raise KafkaError(f"end offsets: {type(e).__name__}: {e}") from e
                log.info("end offsets failed (%s: %s); trying a new client", type(e).__name__, e)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.signal.close()
        self.close_offsets()

    def close_offsets(self) -> None:
        clients, self._offsets, self._marks = (self._offsets, self._marks), None, None
        for client in clients:
            if client is not None:
                client.close()

    def lag(self) -> dict[str, dict[str, Any]]:
        """Per fold (projection or join): records not yet applied (see `Fold.behind`), seconds
        behind, late events seen, generation, offsets removed from the log before it applied
        them (and the last such ranges), and its failure if it failed."""
        ends, progress = self.end_offsets(), self.progress()
        letters = self.dead_letters()
        now = datetime.now(UTC)
        out = {}
        for name, fold in FOLDS.items():
            p = progress.get(name, {})
            applied = p.get("offsets", {})
            behind = fold.behind(applied, ends, self.topics, self.settings.partitions)
            updated = p.get("updated_at")
            seconds = (now - updated).total_seconds() if behind and updated else 0.0
            out[name] = {
                "events": behind,
                "seconds": round(seconds, 3),
                "late_events": int(p.get("late_events", 0)),
                "generation": int(p.get("generation", 0)),
                "lost_offsets": int(p.get("lost_offsets") or 0),
            }
            if p.get("data_loss"):
                out[name]["data_loss"] = p["data_loss"]
            for key in ("version", "building_version", "build_error"):  # guarantee 25
                if p.get(key):
                    out[name][key] = p[key]
            if p.get("building_version") and p.get("build_started_at"):
                out[name]["build_started_at"] = wire_value(p["build_started_at"])
                if p.get("build_total"):  # events folded of the log's, so far
                    out[name].update(build_done=p["build_done"], build_total=p["build_total"])
            if p.get("build_report"):  # what the last verified build changed
                out[name]["build_report"] = p["build_report"]
            if isinstance(fold, Projection):  # it parks what its fold cannot apply
                parked = letters.get(name, Summary())
                out[name].update(
                    parked_events=parked.parked_events,
                    parked_aggregates=parked.parked_aggregates,
                    skipped_events=parked.skipped_events,
                )
                if parked.first_error is not None:
                    out[name]["first_parked_error"] = parked.first_error
            if counted := self.counted(fold):
                out[name]["counted"] = counted
            if p.get("error"):
                out[name]["failed"] = {
                    "error": p["error"],
                    "offsets": p.get("error_offsets") or {},
                    "at": wire_value(p.get("failed_at")),
                }
        return out
