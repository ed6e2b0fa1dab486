"""Command processing: the single writer of each partition.

Processors form one consumer group on the commands topic. The owner of partition `p` keeps the
state of every aggregate in `p` in memory (restored from the snapshot topic on assignment),
decides each command, and writes events, snapshots, idempotency records, the reply and where
processing resumes (the next command offset) in one Kafka transaction. Each partition has its
own transactional id, so a new owner's `init_transactions` fences a zombie that still thinks it
owns the partition and aborts whatever it had in flight. Any failure throws the in-memory state
away and starts over from what is committed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from commands.handling import (
    AggregateRecord,
    IdempotencyRecord,
    Outcome,
    PartitionState,
    handle,
)
from commands.keys import KeyStore
from commands.messages import CommandMessage, LogPosition, Reply
from commands.registry import AGGREGATES
from config.retry import Backoff
from config.settings import (
    IDLE_POLL_MS,
    KAFKA_REQUEST_TIMEOUT_MS,
    Settings,
    kafka_client_options,
    kafka_consumer_options,
)
from config.topics import Topics
from events.partitioning import partition_for
from events.serialization import dumps, encode, loads
from events.store import abort_within, close_within, commit_within, committed_reader, drain

log = logging.getLogger(__name__)

# The wait before a new session after one failed: doubling, while Kafka stays away, from the
# first to the longest. The longest bounds how late the processor notices Kafka's return: with
# 10 s, the first commands after a broker's restart timed out (504) for up to 10 s more.
SESSION_BACKOFF_S = 0.5
SESSION_BACKOFF_MAX_S = 2.0

Decided = tuple[CommandMessage, Outcome]


class OffsetsMoved(Exception):
    """An event did not get the offset its reply announced: the transaction must not commit."""


class Expired(Exception):
    """A command's deadline passed before its transaction could commit: the API may already
    have answered 504, so the transaction must not commit. Started over from Kafka, the command
    is decided again, and refused as expired."""


class SnapshotReplica:
    """Every processor's read-only copy of the latest state of the aggregates in partitions it
    does not own, for reference checks (e.g. does this customer exist?). Eventually consistent;
    caught up on a miss. The partitions a processor owns are in its own memory, current."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = committed_reader(bootstrap)
        parts = self.consumer.partitions_for_topic(topic) or set()
        self.all = [TopicPartition(topic, p) for p in sorted(parts)]
        self.tps: list[TopicPartition] = []
        self.latest: dict[tuple[str, str], AggregateRecord] = {}
        self.skip(set())

    def skip(self, owned: set[int]) -> None:
        """Follow every partition but the `owned` ones; one given up is read from its start."""
        tps = [tp for tp in self.all if tp.partition not in owned]
        added = [tp for tp in tps if tp not in self.tps]
        self.tps = tps
        self.consumer.assign(tps)
        if added:
            self.consumer.seek_to_beginning(*added)

    def _apply(self, records: list[ConsumerRecord]) -> None:
        for r in records:
            if r.value is not None:
                doc = loads(r.value)
                key = (doc["aggregate_type"], doc["aggregate_id"])
                self.latest[key] = AggregateRecord.from_snapshot(doc)

    def poll(self) -> None:
        if not self.tps:
            return
        for records in self.consumer.poll(timeout_ms=0).values():
            self._apply(records)

    def catch_up(self, timeout: float = 5.0) -> None:
        if self.tps:
            self._apply(list(drain(self.consumer, self.tps, timeout)))

    def close(self) -> None:
        self.consumer.close()


class References:
    """Reference lookups: local partitions first (they include this batch's decisions), then the
    replica, caught up once if the aggregate is not there yet."""

    def __init__(self, owners: dict[int, PartitionOwner], replica: SnapshotReplica, n: int):
        self.owners, self.replica, self.n = owners, replica, n

    def get(self, aggregate_type: str, aggregate_id: str) -> object | None:
        key = (aggregate_type, aggregate_id)
        owner = self.owners.get(partition_for(aggregate_id, self.n))
        if owner is not None:
            local = owner.state.aggregates.get(key)
            return local.state if local else None
        if key not in self.replica.latest:
            self.replica.catch_up()
        found = self.replica.latest.get(key)
        return found.state if found else None


class PartitionOwner:
    """Everything one processor holds for one partition it owns."""

    def __init__(self, settings: Settings, topics: Topics, partition: int) -> None:
        self.settings, self.topics, self.partition = settings, topics, partition
        self.producer = KafkaProducer(
            bootstrap_servers=settings.kafka(),
            **kafka_client_options(),
            metrics_enabled=False,  # kafka-python's own, unused: a tenth of a sender's CPU
            transactional_id=topics.transactional_id(partition),
            acks="all",
            enable_idempotence=True,
            linger_ms=1,
            transaction_timeout_ms=30000,
            # A new transaction waits for the previous one's markers; the 100 ms default backoff
            # caps a partition at ~10 transactions/s (measured: see docs/benchmarks-journal.md).
            retry_backoff_ms=10,
            max_block_ms=int(settings.kafka_timeout_s * 1000),
            # A send the broker has not acknowledged in this time fails the transaction, and the
            # processor starts again from what was committed (with new producers), rather than
            # leaving the partition's commands waiting on a producer that may not reconnect.
            request_timeout_ms=int(settings.kafka_timeout_s * 1000),
            delivery_timeout_ms=int(settings.kafka_timeout_s * 1000) + 1000,
        )
        self.resume_at: int | None = None  # the next command to process, if ever recorded
        self.next_offset: dict[str, int] = {}
        try:
            # Fences any previous owner of this partition and aborts its open transaction.
            self.producer.init_transactions()
            # Its subjects' keys (guarantee 27): each is this partition's alone, as its commands.
            self.keys = KeyStore(settings.database())
            self.state = self._restore()
        except BaseException:
            # Not left behind: its sender would go on asking for the transactional id, and
            # fence (or abort the transaction of) the next owner that claims the partition.
            close_within(self.producer, 5)
            raise

    def _restore(self) -> PartitionState:
        """Read this partition's committed write-model state, where its processing resumes and
        its event topics' end offsets (see `process`), with one consumer. Read after fencing,
        so no other transaction is open there: the last stable offsets are the ends."""
        state = PartitionState()
        p, topics = self.partition, self.topics
        consumer = committed_reader(self.settings.kafka())
        try:
            events = [TopicPartition(topics.events(name), p) for name in AGGREGATES]
            self.next_offset = {
                tp.topic: int(offset) for tp, offset in consumer.end_offsets(events).items()
            }
            tps = [
                TopicPartition(t, p)
                for t in (topics.snapshots, topics.idempotency, topics.command_offsets)
            ]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            now = time.time()
            for r in drain(consumer, tps, timeout=60.0):
                if r.value is None:
                    continue
                doc = loads(r.value)
                if r.topic == topics.snapshots:
                    key = (doc["aggregate_type"], doc["aggregate_id"])
                    state.aggregates[key] = AggregateRecord.from_snapshot(doc)
                elif r.topic == topics.idempotency:
                    doc.setdefault("at", r.timestamp / 1000)  # records from before `at` existed
                    state.remember(r.key.decode(), IdempotencyRecord(**doc), now)
                else:
                    self.resume_at = int(doc["next_offset"])
        finally:
            consumer.close()
        log.info("partition %s restored: %s aggregates", self.partition, len(state.aggregates))
        return state

    def process(self, records: list[ConsumerRecord], refs: References) -> int:
        """Decide a batch of commands and commit all its effects in one transaction.

        Everything the transaction writes goes out at once, replies included, although a reply
        carries its events' offsets: this partition of the event topics has one writer, its
        owner (fenced by its transactional id), so the offset each event will get is known in
        advance — the end offset found on claiming it, plus one per event, plus one per commit
        marker. The offsets Kafka gives are checked before the commit; a difference (something
        else wrote there) aborts the transaction and starts over from Kafka. Waiting for the
        events' offsets before sending the rest cost two more round trips per transaction.

        Where processing resumes is a record of the transaction too (the `command-offsets`
        topic), not the consumer group's offset: `send_offsets_to_transaction` costs two more
        requests and a commit marker in `__consumer_offsets` per transaction. Returns the next
        command offset, now committed."""
        self.producer.begin_transaction()
        try:
            # Every send's future, with the offset it must get (an event's) or None: each is
            # checked before the commit, since kafka-python does not fail a transaction for
            # every send that failed (a snapshot or a resume point lost from a committed
            # transaction would make a restart decide from an older state).
            expected: list[tuple[Any, int | None]] = []
            decided = [self._decide(r, refs, expected) for r in records]
            pending = [d for d in decided if d is not None]
            changed = {(m.aggregate_type, m.aggregate_id) for m, o in pending if o.events}
            expected += [(f, None) for f in self._snapshot(changed)]
            replies: dict[str, list[Reply]] = {}
            for msg, outcome in pending:
                status = 200 if outcome.replay else outcome.status
                reply = Reply(msg.command_id, status, outcome.body, outcome.replay)
                replies.setdefault(msg.reply_to, []).append(reply)
            for reply_to, batch in replies.items():  # one record per API process
                answers = self.producer.send(
                    self.topics.replies,
                    key=reply_to.encode(),
                    value=Reply.encode_many(batch),
                    partition=partition_for(reply_to, self.settings.partitions),
                )
                expected.append((answers, None))
            next_command: int = records[-1].offset + 1
            resume = self.producer.send(
                self.topics.command_offsets,
                key=str(self.partition).encode(),
                value=dumps({"next_offset": next_command}),
                partition=self.partition,
            )
            expected.append((resume, None))
            # Bounded, as every wait here: a send the broker does not acknowledge fails the
            # transaction (the delivery timeout), but a producer whose sender is stuck (a
            # coordinator gone with its broker) would keep the partition's commands waiting.
            wait = self.settings.kafka_timeout_s + 1
            self.producer.flush(timeout=wait)
            touched = set()
            for future, offset in expected:
                got = future.get(timeout=wait)
                if offset is None:
                    continue
                if got.offset != offset:
                    raise OffsetsMoved(
                        f"{got.topic}[{got.partition}] gave offset {got.offset}, not {offset}: "
                        "another producer writes there; starting over from Kafka"
                    )
                touched.add(got.topic)
            # Checked last, so a commit is never asked for after a deadline (see `_commit`).
            now = time.time()
            late = [m.command_id for m, o in pending if o.events and now > m.deadline]
            if late:
                raise Expired(f"commands {late} expired before their transaction committed")
            self._commit()
            for topic in touched:
                self.next_offset[topic] += 1  # the commit marker
            return next_command
        except BaseException:
            # Fenced or broken: the caller throws this state away and restarts from Kafka.
            with contextlib.suppress(Exception):
                abort_within(self.producer, self.settings.kafka_timeout_s)
            raise

    def _decide(
        self, record: ConsumerRecord, refs: References, expected: list[tuple[Any, int | None]]
    ) -> Decided | None:
        try:
            msg = CommandMessage.decode(record.value)
        except (ValueError, TypeError, KeyError):
            log.error("skipping unreadable command at offset %s", record.offset)
            return None
        outcome = handle(msg, self.state, refs, time.time, lambda: str(uuid.uuid4()), self.keys)
        position = None
        for e in outcome.events:
            topic = self.topics.events(e.aggregate_type)
            offset = self.next_offset[topic]
            self.next_offset[topic] = offset + 1
            future = self.producer.send(
                topic,
                key=f"{e.aggregate_id}:{e.version}".encode(),
                value=encode(e),
                partition=self.partition,
            )
            expected.append((future, offset))
            position = LogPosition(topic, self.partition, offset)
        if position is not None:
            # The same body as the idempotency record's (a retry replays it with its position).
            outcome.body["position"] = position.token()
            if msg.idempotency_key is not None:
                record_ = self.state.idempotency[msg.idempotency_key]  # recorded by handle()
                sent = self.producer.send(
                    self.topics.idempotency,
                    key=msg.idempotency_key.encode(),
                    value=dumps(record_),
                    partition=self.partition,
                )
                expected.append((sent, None))
        return msg, outcome

    def _commit(self) -> None:
        """Bounded by `kafka_timeout_s`: the API waits that long past a command's deadline
        (plus the clock skew) for its reply, so a commit asked for before the deadline is known
        by then. A broker that already holds the commit request may still complete it, later:
        the one case where a 504 was applied after all."""
        commit_within(self.producer, self.settings.kafka_timeout_s)

    def _snapshot(self, touched: set[tuple[str, str]]) -> list[Any]:
        """Send the snapshot of each aggregate `touched`; returns the sends' futures."""
        futures = []
        for agg_type, agg_id in touched:
            snap = self.state.aggregates[(agg_type, agg_id)].snapshot(agg_type, agg_id)
            futures.append(
                self.producer.send(
                    self.topics.snapshots,
                    key=f"{agg_type}:{agg_id}".encode(),
                    value=dumps(snap),
                    partition=self.partition,
                )
            )
        return futures

    def close(self) -> None:
        close_within(self.producer, 5)
        self.keys.close()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, processor: CommandProcessor) -> None:
        self.processor = processor

    def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        for tp in revoked:
            owner = self.processor.owners.pop(tp.partition, None)
            if owner is not None:
                owner.close()

    def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        # Fetch nothing until the partition is fenced and restored (see _claim).
        self.processor.consumer_paused(assigned)


class CommandProcessor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.owners: dict[int, PartitionOwner] = {}
        self._claims: list[TopicPartition] = []
        self._consumer: KafkaConsumer | None = None
        self._stopping = threading.Event()
        self._reached = False  # this session claimed a partition: Kafka was up
        self._processed: dict[TopicPartition, OffsetAndMetadata] = {}  # not yet in the group
        self._reported_at = 0.0

    def stop(self) -> None:
        self._stopping.set()

    def consumer_paused(self, assigned: list[TopicPartition]) -> None:
        assert self._consumer is not None
        self._consumer.pause(*assigned)
        self._claims.extend(assigned)

    def run(self) -> None:
        """Process commands until `stop()`; start over from committed state after any error."""
        backoff, failed = Backoff(SESSION_BACKOFF_S, SESSION_BACKOFF_MAX_S), 0
        while not self._stopping.is_set():
            self._reached = False
            try:
                self._session()
                backoff.reset()
                failed = 0
            except Exception as e:
                if self._reached:  # Kafka answered this session: not the outage backed off from
                    backoff.reset()
                    failed = 0
                failed += 1
                if failed == 1:  # the first failure in a row with its traceback, later ones a line
                    log.exception("command processing failed; restarting from committed state")
                else:
                    log.warning("command processing failed again (%d in a row): %s", failed, e)
                self._stopping.wait(backoff.next())
            finally:
                self._close()

    def _session(self) -> None:
        s = self.settings
        self._consumer = consumer = KafkaConsumer(
            bootstrap_servers=s.kafka(),
            metrics_enabled=False,
            group_id=self.topics.processor_group,
            enable_auto_commit=False,
            isolation_level="read_committed",
            auto_offset_reset="earliest",
            max_poll_records=500,
            session_timeout_ms=10000,
            heartbeat_interval_ms=1000,
            request_timeout_ms=KAFKA_REQUEST_TIMEOUT_MS,
            **kafka_consumer_options(),
        )
        consumer.subscribe([self.topics.commands], listener=_Rebalance(self))
        replica = SnapshotReplica(s.kafka(), self.topics.snapshots)
        refs = References(self.owners, replica, s.partitions)
        try:
            while not self._stopping.is_set():
                batches = consumer.poll(timeout_ms=IDLE_POLL_MS)
                self._claim(consumer)
                replica.skip(set(self.owners))
                replica.poll()
                for tp, records in batches.items():
                    owner = self.owners.get(tp.partition)
                    if owner is not None and records:
                        next_command = owner.process(records, refs)
                        self._processed[tp] = OffsetAndMetadata(next_command, "", -1)
                self._report(consumer, idle=not batches)
        finally:
            replica.close()

    def _report(self, consumer: KafkaConsumer, idle: bool) -> None:
        """Copy what is processed to the consumer group's offsets, at most once a second (or
        when idle), for tools and `/health` to show the lag. Only a copy: processing resumes
        from the `command-offsets` records, which commit with the rest (see `process`)."""
        now = time.monotonic()
        if not self._processed or (not idle and now - self._reported_at < 1.0):
            return
        offsets, self._processed, self._reported_at = self._processed, {}, now
        try:
            consumer.commit_async(offsets, callback=_log_failed_report)
        except KafkaError as e:  # never a reason to stop processing
            _log_failed_report(offsets, e)

    def _claim(self, consumer: KafkaConsumer) -> None:
        while self._claims:
            tp = self._claims.pop()
            if tp not in consumer.assignment():
                continue
            self.owners[tp.partition] = PartitionOwner(self.settings, self.topics, tp.partition)
            self._reached = True
            owner = self.owners[tp.partition]
            # A partition no command-offsets record names yet (a new deployment, or one from
            # before that topic) resumes from the group's offset, asked within a request's
            # timeout: without one, kafka-python waits for the group's coordinator as long as
            # Kafka is away, and the processor (and its stop) with it.
            committed = (
                owner.resume_at
                if owner.resume_at is not None
                else consumer.committed(tp, timeout_ms=KAFKA_REQUEST_TIMEOUT_MS)
            )
            if committed is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
            consumer.resume(tp)
            log.info("claimed partition %s at offset %s", tp.partition, committed)

    def _close(self) -> None:
        """Never raises: `run` goes on to a new session whatever failed (a processor whose
        clean-up raised would leave its group for good, its partitions to the others)."""
        for owner in self.owners.values():
            owner.close()
        self.owners.clear()
        self._claims.clear()
        self._processed.clear()
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False)
            except Exception:
                log.warning("the command consumer did not close cleanly", exc_info=True)
            self._consumer = None


def _log_failed_report(offsets: object, response: object) -> None:
    if isinstance(response, Exception):  # a rebalance, say: the next report catches up
        log.debug("could not copy processed offsets to the group: %s", response)


def serve(settings: Settings) -> Any:
    processor = CommandProcessor(settings)
    processor.run()
    return processor
