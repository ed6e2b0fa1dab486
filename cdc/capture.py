"""`logfold cdc`: stream the captured tables' changes from the Postgres WAL into Kafka.

A publication names the captured tables; a logical replication slot (plugin `pgoutput`) keeps
the server's WAL until we confirm a position. Each decoded transaction becomes records in the
`cdc.<table>` topics (format in docs/cdc.md); the slot's position is confirmed only after Kafka
acknowledged every record before it, so a crash loses nothing: Postgres resends everything after
the confirmed position, and the records' positions let consumers drop what they already have.

Those consumers take a record older than one they hold for a resend, so a record Kafka did not
take must have nothing after it in its changelog: at the first send that fails, the session's
producer stops at once (what it still holds is dropped, not sent), and the next session resends
everything from the confirmed position, in order.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import psycopg2.extras
from kafka import KafkaProducer
from kafka.errors import KafkaError, MessageSizeTooLargeError
from sqlalchemy import Table

from cdc import pgoutput
from cdc.changes import Change, Snapshot, WalPosition, record_for
from config.retry import Backoff
from config.settings import Settings, kafka_client_options, slot_name
from config.topics import Topics
from events.store import close_within, stop_sending
from projections.base.wire import wire_row, wire_value
from projections.registry import CAPTURED

log = logging.getLogger(__name__)

# The wait before streaming again after a failure: doubling while Postgres or Kafka stays away,
# from the first to the longest, which bounds how late the changelogs resume once it is back.
# A session that streamed (the failure ended a stream, it did not stop one from starting)
# waits the first again.
RETRY_S = 0.5
RETRY_MAX_S = 2.0

FLUSH_EVERY_S = 0.02  # at most this long between a commit and its records' Kafka flush
FLUSH_RECORDS = 2000  # or this many records, whichever comes first


def _key_columns(table: Table) -> tuple[str, ...]:
    return tuple(c.name for c in table.primary_key.columns)


def prepare(settings: Settings, tables: dict[str, Table] = CAPTURED) -> None:
    """Full before-images on the captured tables and a publication listing exactly them."""
    name = slot_name(settings)
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        for table in tables:
            identity = conn.execute(
                "SELECT relreplident FROM pg_class WHERE oid = to_regclass(%s)", (table,)
            ).fetchone()
            if identity is None:
                raise RuntimeError(f"table {table} does not exist; run `logfold migrate` first")
            if identity[0] != "f":
                conn.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        listed = ", ".join(tables)
        exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
        if exists:
            conn.execute(f"ALTER PUBLICATION {name} SET TABLE {listed}")
        else:
            # TRUNCATE is not published: it has no rows to turn into tombstones (use DELETE).
            conn.execute(
                f"CREATE PUBLICATION {name} FOR TABLE {listed} "
                "WITH (publish = 'insert, update, delete')"
            )


def drop(settings: Settings) -> bool:
    """Drop the slot (releasing the WAL it holds) and the publication. True if a slot existed."""
    name = slot_name(settings)
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        found = conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (name,),
        ).fetchall()
        conn.execute(f"DROP PUBLICATION IF EXISTS {name}")
        conn.execute("DELETE FROM cdc_slots WHERE slot = %s", (name,))
    return bool(found)


@dataclass
class _Pending:
    futures: list[Any]
    confirm: int  # the LSN to confirm once these records are acknowledged


class Capture:
    def __init__(self, settings: Settings, tables: dict[str, Table] = CAPTURED) -> None:
        self.settings, self.tables = settings, tables
        self.topics = Topics(settings.topic_prefix)
        self.slot = slot_name(settings)
        self._stopping = threading.Event()
        self._relations: dict[int, pgoutput.Relation] = {}
        self.confirmed = 0  # last LSN confirmed to the slot (for tests and logs)
        self.failures = 0  # times streaming failed and started over from the slot
        self.streaming = False  # this session's replication started
        # The first record this session's producer failed to write: nothing is sent after it.
        self.send_failed: BaseException | None = None
        self.sessions = 0  # streaming sessions started (a record's errback names its own)

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Stream until stop(); on a Kafka or Postgres failure, start over from the slot."""
        prepare(self.settings, self.tables)
        backoff = Backoff(RETRY_S, RETRY_MAX_S)
        while not self._stopping.is_set():
            self.streaming = False
            try:
                self._stream()
            except (KafkaError, psycopg2.Error, psycopg.Error, OSError) as e:
                self.failures += 1
                if self.streaming:
                    backoff.reset()
                wait = backoff.next()
                log.warning("cdc: %s; resuming from the slot in %.1fs", e, wait)
                self._stopping.wait(wait)

    def stop(self) -> None:
        self._stopping.set()

    def _stream(self) -> None:
        self.send_failed, self.sessions = None, self.sessions + 1
        producer = KafkaProducer(
            bootstrap_servers=self.settings.kafka(),
            **kafka_client_options(),
            metrics_enabled=False,
            acks="all",
            # In order: a retried batch must not land after a later one in a changelog
            # partition, where readers would take it for a resend and drop it.
            enable_idempotence=True,
            linger_ms=5,
            max_request_size=self.settings.cdc_max_record_bytes,
            max_block_ms=int(self.settings.kafka_timeout_s * 1000),
            request_timeout_ms=int(self.settings.kafka_timeout_s * 1000),
        )
        conn = psycopg2.connect(
            self.settings.database(),
            connection_factory=psycopg2.extras.LogicalReplicationConnection,
            options="-c timezone=UTC -c datestyle=ISO",
        )
        try:
            cur = conn.cursor()
            self._ensure_slot(cur, producer)
            cur.start_replication(
                slot_name=self.slot,
                decode=False,
                options={"proto_version": "1", "publication_names": self.slot},
            )
            log.info("cdc: streaming slot %s into %scdc.*", self.slot, self.topics.prefix)
            self.streaming = True
            self._relations.clear()
            self._consume(cur, producer)
        finally:
            conn.close()
            if self.send_failed is not None:
                stop_sending(producer, 1)  # (stopped already by `_failed`: this waits for it)
            close_within(producer, 1)

    def _consume(self, cur: Any, producer: KafkaProducer) -> None:
        begin: pgoutput.Begin | None = None
        changes: list[Change] = []
        pending: list[_Pending] = []
        first_pending = 0.0
        while not self._stopping.is_set():
            msg = cur.read_message()
            if msg is None:
                if pending:
                    self._confirm(cur, producer, pending)
                elif begin is None and cur.wal_end > self.confirmed:
                    # Caught up and idle: nothing unacknowledged lies before the server's end.
                    self._feedback(cur, cur.wal_end)
                select.select([cur.connection], [], [], 0.2)
                continue
            message = pgoutput.decode(msg.payload)
            if isinstance(message, pgoutput.Begin):
                begin, changes = message, []
            elif isinstance(message, pgoutput.Relation):
                self._relations[message.oid] = message
            elif isinstance(message, pgoutput.Commit):
                assert begin is not None
                futures = [self._send(producer, c, message) for c in changes]
                if not pending:
                    first_pending = time.monotonic()
                pending.append(_Pending(futures, message.end_lsn))
                begin, changes = None, []
                records = sum(len(p.futures) for p in pending)
                if records >= FLUSH_RECORDS or time.monotonic() - first_pending >= FLUSH_EVERY_S:
                    self._confirm(cur, producer, pending)
            elif isinstance(message, pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
                assert begin is not None
                change = self._change(
                    message, WalPosition(begin.final_lsn, len(changes) + 1), begin.xid
                )
                if change is not None:
                    changes.append(change)

    def _confirm(self, cur: Any, producer: KafkaProducer, pending: list[_Pending]) -> None:
        """Wait for Kafka to acknowledge the pending records, then confirm their position."""
        producer.flush(timeout=self.settings.kafka_timeout_s)
        for p in pending:
            for future in p.futures:
                if not future.is_done:
                    raise KafkaError("records not acknowledged in time")
                if future.failed():
                    raise future.exception
        self._feedback(cur, pending[-1].confirm)
        pending.clear()

    def _feedback(self, cur: Any, lsn: int) -> None:
        cur.send_feedback(write_lsn=lsn, flush_lsn=lsn, reply=True)
        self.confirmed = lsn

    # -- decoding -------------------------------------------------------------------------

    def _change(
        self,
        message: pgoutput.Insert | pgoutput.Update | pgoutput.Delete,
        position: WalPosition,
        xid: int,
    ) -> Change | None:
        relation = self._relations[message.relation]
        table = self.tables.get(relation.name)
        if table is None:
            return None
        if isinstance(message, pgoutput.Delete):
            before = self._row(relation, message.old)
            assert before is not None
            key = self._key(table, before)
            return Change(relation.name, "delete", key, None, before, position, xid=xid)
        if isinstance(message, pgoutput.Insert):
            row = self._row(relation, message.new)
            assert row is not None
            key = self._key(table, row)
            return Change(relation.name, "insert", key, row, None, position, xid=xid)
        before = self._row(relation, message.old)
        row = self._row(relation, message.new, fill=before)
        assert row is not None
        if row == before:
            return None  # nothing changed (e.g. an upsert that wrote the same values)
        key = self._key(table, row)
        return Change(relation.name, "update", key, row, before, position, xid=xid)

    @staticmethod
    def _row(
        relation: pgoutput.Relation,
        values: tuple[Any, ...] | None,
        fill: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        if values is None:
            return None
        row = {}
        for column, value in zip(relation.columns, values, strict=True):
            if value is pgoutput.UNCHANGED:
                row[column.name] = (fill or {}).get(column.name)
            elif value is None:
                row[column.name] = None
            else:
                row[column.name] = wire_value(pgoutput.to_python(column.type_oid, value))
        return row

    @staticmethod
    def _key(table: Table, row: dict[str, Any]) -> dict[str, Any]:
        return {k: row[k] for k in _key_columns(table)}

    def _send(self, producer: KafkaProducer, change: Change, commit: pgoutput.Commit) -> Any:
        key, value, headers = record_for(change, commit.committed_at)
        try:
            if self.send_failed is None:
                topic = self.topics.cdc(change.table)
                future = producer.send(topic, key=key, value=value, headers=headers)
                return future.add_errback(self._failed, self.sessions, producer, change)
        except AssertionError:  # its accumulator closed by `_failed` meanwhile (another thread)
            if self.send_failed is None:
                raise
        raise KafkaError(
            f"cdc: not sending the change of {change.table} at {change.position}: an earlier "
            f"record was not written ({self.send_failed!r}); starting over from the slot"
        )

    def _failed(
        self, session: int, producer: KafkaProducer, change: Change, error: BaseException
    ) -> None:
        """The first send of the session that failed: stop the producer at once, so nothing
        after it reaches its changelog before the next session resends it (called by
        kafka-python, in its sender's thread or, for a record refused outright, in `send`)."""
        if self.send_failed is not None or session != self.sessions:
            return  # (a record of an earlier session's producer: that session has ended)
        self.send_failed = error
        producer._sender.force_close()  # flags only: the sender stops after this turn
        hint = ""
        if isinstance(error, MessageSizeTooLargeError):
            hint = (
                f"; a row this large needs LOGFOLD_CDC_MAX_RECORD_BYTES (now "
                f"{self.settings.cdc_max_record_bytes}) and the topic's max.message.bytes "
                "raised (kafka-configs --alter --entity-type topics --entity-name "
                f"{self.topics.cdc(change.table)} --add-config max.message.bytes=<bytes>), "
                "then CDC restarted"
            )
        log.error(
            "cdc: Kafka did not take the change of %s %s at %s (%r): nothing after it is "
            "sent, and CDC starts over from the slot's confirmed position%s",
            change.table,
            change.key,
            change.position,
            error,
            hint,
        )

    # -- the slot and its first snapshot ---------------------------------------------------

    def _ensure_slot(self, cur: Any, producer: KafkaProducer) -> None:
        """Create the slot if needed. A new slot exports the snapshot it starts from: every
        existing row is emitted as an insert first, so the changelogs start complete."""
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
            ).fetchone()
            done = conn.execute("SELECT 1 FROM cdc_slots WHERE slot = %s", (self.slot,)).fetchone()
            if exists and done:
                return
            if exists:  # a crash during the first snapshot: start it again
                log.warning("cdc: slot %s never finished its first snapshot; redoing it", self.slot)
                conn.execute("SELECT pg_drop_replication_slot(%s)", (self.slot,))
        cur.execute(f"CREATE_REPLICATION_SLOT {self.slot} LOGICAL pgoutput EXPORT_SNAPSHOT")
        _, consistent_point, snapshot, _ = cur.fetchone()
        start = _parse_lsn(consistent_point) - 1  # below every change the slot will stream
        sent = 0
        failed: list[BaseException] = []  # every send's outcome counts, not only the flush
        with psycopg.connect(self.settings.database()) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
            # Which transactions the rows hold, for readers to tell whether theirs do too.
            found = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
            assert found is not None
            exported = Snapshot.parse(found[0])
            seq = 0
            for name, table in self.tables.items():
                for row in _rows(conn, name):
                    seq += 1
                    key_columns, position = self._key(table, row), WalPosition(start, seq)
                    change = Change(
                        name, "insert", key_columns, row, None, position, snapshot=exported
                    )
                    key, value, headers = record_for(change, None)
                    future = producer.send(
                        self.topics.cdc(name), key=key, value=value, headers=headers
                    )
                    future.add_errback(failed.append)
                    sent += 1
            conn.execute("COMMIT")
        producer.flush(timeout=max(self.settings.kafka_timeout_s, 60.0))
        if failed:
            # Not marked done: the next start drops the slot and takes the snapshot again.
            raise KafkaError(
                f"cdc: {len(failed)} of {sent} rows of the first snapshot were not written to "
                f"Kafka ({failed[0]!r}); the snapshot will be taken again"
            )
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO cdc_slots (slot, consistent_point) VALUES (%s, %s) "
                "ON CONFLICT (slot) DO UPDATE SET consistent_point = excluded.consistent_point",
                (self.slot, consistent_point),
            )
        log.info("cdc: created slot %s; first snapshot sent %d rows", self.slot, sent)


def _rows(conn: psycopg.Connection[Any], table: str) -> Iterator[dict[str, Any]]:
    with conn.cursor(name=f"snapshot_{table}") as cur:
        cur.execute(f"SELECT * FROM {table}")
        names = [d.name for d in cur.description or ()]
        for values in cur:
            yield wire_row(dict(zip(names, values, strict=True)))


def _parse_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
