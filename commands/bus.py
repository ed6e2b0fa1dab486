"""The API side of command processing: send a command to its partition's owner, wait for the
reply. Each API process reads the replies partition its own id hashes to."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future

from kafka import KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from commands.messages import CommandMessage, Reply
from config.settings import IDLE_POLL_MS, Settings, kafka_client_options
from config.topics import Topics
from events.partitioning import partition_for
from events.store import close_within, committed_reader

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """Kafka could not take the command; nothing was written."""


class ReplyTimeout(Exception):
    """No reply in time: the command was not committed by its deadline, and never will be,
    unless Kafka took its commit request but did not acknowledge it (see `_past_deadline`)."""


class CommandBus:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.instance_id = f"api-{uuid.uuid4()}"
        self._waiting: dict[str, Future[Reply]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._producer: KafkaProducer | None = None
        self._resume_at: int | None = None
        self._thread = threading.Thread(target=self._read_replies, name="replies", daemon=True)
        self._thread.start()

    def _get_producer(self) -> KafkaProducer:
        if self._producer is None:
            with self._lock:
                if self._producer is None:
                    self._producer = KafkaProducer(
                        bootstrap_servers=self.settings.kafka(),
                        **kafka_client_options(),
                        metrics_enabled=False,  # kafka-python's own: a tenth of its CPU
                        acks="all",
                        enable_idempotence=True,
                        linger_ms=1,
                        max_block_ms=int(self.settings.kafka_timeout_s * 1000),
                        request_timeout_ms=int(self.settings.kafka_timeout_s * 1000),
                        delivery_timeout_ms=int(self.settings.kafka_timeout_s * 1000) + 1000,
                    )
        return self._producer

    def _drop_producer(self, broken: KafkaProducer) -> None:
        """After a send the broker never acknowledged, the next command goes out on a new
        producer (new metadata, a new producer id). kafka-python's idempotent producer can stay
        stuck on a partition whose leader moved, every batch there expiring for minutes: seen
        when a broker of a cluster was killed and came back."""
        with self._lock:
            if self._producer is not broken:
                return
            self._producer = None
        # Not from here: this runs on the producer's own sender thread, which close() joins.
        # Bounded and never raising: a close whose records are still unacknowledged raised
        # (in that thread) instead of dropping them.
        threading.Thread(target=close_within, args=(broken, 1.0), daemon=True).start()

    def new_message(self, **fields: object) -> CommandMessage:
        """A command addressed to this process's replies, expiring after the reply timeout."""
        return CommandMessage(
            reply_to=self.instance_id,
            deadline=time.time() + self.settings.command_timeout_s,
            **fields,  # type: ignore[arg-type]
        )

    def submit(self, msg: CommandMessage) -> Reply:
        """Send and wait. Raises Unavailable (nothing was or will be written) or ReplyTimeout."""
        if not self._ready.wait(self.settings.kafka_timeout_s):
            raise Unavailable("cannot reach Kafka to receive replies")
        future: Future[Reply] = Future()
        failed: list[BaseException] = []  # the send's error, if the broker did not ack it
        with self._lock:
            self._waiting[msg.command_id] = future
        try:
            partition = partition_for(msg.aggregate_id, self.settings.partitions)
            try:
                producer = self._get_producer()
                sent = producer.send(
                    self.topics.commands,
                    key=msg.aggregate_id.encode(),
                    value=msg.encode(),
                    partition=partition,
                )
            except KafkaError as e:  # never left this process: certainly not written
                raise Unavailable(str(e)) from e
            # No wait for the ack: the reply implies it. A send that fails may still have
            # reached the broker; its reply, if it was decided in time, still reaches us, and
            # otherwise the command expires unapplied.
            sent.add_errback(failed.append)
            sent.add_errback(lambda _: self._drop_producer(producer))
            try:
                return future.result(timeout=self._past_deadline(msg))
            except TimeoutError as e:
                if failed:
                    raise Unavailable(str(failed[0])) from e
                raise ReplyTimeout() from e
        finally:
            with self._lock:
                self._waiting.pop(msg.command_id, None)

    def _past_deadline(self, msg: CommandMessage) -> float:
        """Seconds until the outcome of a commit asked for just before the deadline has surely
        arrived: a processor asks for none after it (on its clock, within the skew of ours),
        and waits `kafka_timeout_s` at most for Kafka to acknowledge one; then 1 s to read the
        reply. Past that, only a broker that took the commit request without acknowledging
        it can still apply the command."""
        s = self.settings
        return max(msg.deadline + s.clock_skew_s + s.kafka_timeout_s + 1.0 - time.time(), 0.1)

    def _read_replies(self) -> None:
        while not self._stopping.is_set():
            try:
                self._consume_replies()
            except Exception:
                self._ready.clear()
                log.exception("reply reader failed; reconnecting")
                self._stopping.wait(1.0)

    def _consume_replies(self) -> None:
        consumer = committed_reader(self.settings.kafka(), request_timeout_ms=10000)
        try:
            tp = TopicPartition(
                self.topics.replies, partition_for(self.instance_id, self.settings.partitions)
            )
            consumer.assign([tp])
            if self._resume_at is None:
                consumer.seek_to_end(tp)
                # Resolve now: replies to commands sent from here on come after this offset.
                self._resume_at = consumer.position(tp)
            else:  # reconnecting: pick up replies that arrived meanwhile
                consumer.seek(tp, self._resume_at)
            self._ready.set()
            while not self._stopping.is_set():
                polled = consumer.poll(timeout_ms=IDLE_POLL_MS)
                self._resume_at = consumer.position(tp)
                me = self.instance_id.encode()
                for records in polled.values():
                    for r in records:
                        if r.key != me:  # another API process hashed to this partition
                            continue
                        for reply in Reply.decode_many(r.value):
                            with self._lock:
                                future = self._waiting.get(reply.command_id)
                            if future is not None and not future.done():
                                future.set_result(reply)
        finally:
            consumer.close()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        if self._producer is not None:
            close_within(self._producer, 5)
