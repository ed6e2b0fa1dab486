"""One endpoint's deliveries: its view's changelog read from the endpoint's durable cursor, each
change that concerns it POSTed until acknowledged (or dead-lettered once its retry window has
passed), and only then the cursor moved past it.

One delivery at a time per endpoint, in changelog order: that is what keeps the order per key
(and a total order besides), and what makes a crash harmless: the cursor never passes a change
that was neither acknowledged nor kept as a dead letter, so a new worker starts with it again,
under the same `webhook-id`. A worker has its own Kafka consumer, connection and thread: a slow
or failing endpoint holds up only its own deliveries."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from cdc.changes import WalPosition, from_record
from config.settings import IDLE_POLL_MS, KAFKA_REQUEST_TIMEOUT_MS, Settings, kafka_consumer_options
from config.topics import Topics
from webhooks import backoff, signing
from webhooks.messages import Message, message_for
from webhooks.outbound import Sender
from webhooks.store import DeadLetter, Endpoint, Gone, Session, WebhookStore

log = logging.getLogger("logfold.webhooks")

# How long a worker may leave the cursor behind changes that did not concern its endpoint
# before it writes it (they are only looked at again after a crash; nothing is delivered twice
# for them).
IDLE_CURSOR_WRITE_S = 1.0


class Stopped(Exception):
    """The worker was told to stop (its endpoint paused or deleted, or the process stopping)."""


@dataclass(frozen=True)
class Attempts:
    delivered: bool
    attempts: int
    error: str | None
    first_attempt_at: datetime


class Worker:
    """Delivers one endpoint's changes in a thread of its own until stopped."""

    def __init__(
        self,
        endpoint: Endpoint,
        settings: Settings,
        store: WebhookStore,
        sender: Sender,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.endpoint_id = endpoint.id
        self.settings, self.store, self.sender, self.rng = settings, store, sender, rng
        self.stopping = threading.Event()
        self.replay_wanted = threading.Event()
        self.replay_wanted.set()  # look for replays asked for while no worker ran
        self.held_elsewhere = False
        self.crashed = False
        self.thread = threading.Thread(target=self.run, name=f"webhook-{endpoint.id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def run(self) -> None:
        try:
            with self.store.session(self.endpoint_id) as session:
                if session is None:
                    self.held_elsewhere = True  # another dispatcher's worker delivers it
                    return
                endpoint = session.load()
                if endpoint is None or not endpoint.active:
                    return
                self._stream(session, endpoint)
        except (Stopped, Gone):
            pass
        except Exception:
            self.crashed = True
            log.exception("webhook %s: worker failed; it starts again", self.endpoint_id)

    def _stream(self, session: Session, endpoint: Endpoint) -> None:
        s = self.settings
        table = endpoint.view
        tp = TopicPartition(Topics(s.topic_prefix).cdc(table), 0)
        consumer = KafkaConsumer(
            bootstrap_servers=s.kafka(),
            metrics_enabled=False,
            enable_auto_commit=False,
            group_id=None,
            # A cursor below the log's start (records deleted) resumes at the start; the
            # offsets in between are counted as skipped, never jumped over in silence.
            auto_offset_reset="earliest",
            fetch_max_wait_ms=IDLE_POLL_MS,
            max_poll_records=500,
            request_timeout_ms=KAFKA_REQUEST_TIMEOUT_MS,
            client_id=f"logfold-webhook-{endpoint.id}",
            **kafka_consumer_options(),
        )
        try:
            consumer.assign([tp])
            consumer.seek(tp, endpoint.cursor)
            self._loop(session, endpoint, consumer, tp)
        finally:
            consumer.close()

    def _loop(
        self, session: Session, endpoint: Endpoint, consumer: KafkaConsumer, tp: TopicPartition
    ) -> None:
        s = self.settings
        cursor = endpoint.cursor
        last = WalPosition.parse(endpoint.last_position) if endpoint.last_position else None
        written = (cursor, last)  # the cursor as Postgres has it
        skipped = 0  # offsets compaction removed, not yet written
        written_at = time.monotonic()
        failing = endpoint.failing_since is not None
        # The retry state a restart resumes: for the first delivery only.
        retrying: Endpoint | None = endpoint

        def write() -> None:
            nonlocal written, skipped, written_at
            if (cursor, last) != written or skipped:
                session.advance(cursor, None if last is None else str(last), skipped)
                written, skipped, written_at = (cursor, last), 0, time.monotonic()

        while not self.stopping.is_set():
            if self.replay_wanted.is_set():
                self.replay_wanted.clear()
                failing = self._replay(session, endpoint, failing)
            records = consumer.poll(timeout_ms=IDLE_POLL_MS).get(tp, [])
            for record in records:
                if record.offset < cursor:
                    continue
                skipped += record.offset - cursor
                try:
                    change = from_record(
                        endpoint.view, record.key, record.value, list(record.headers or ())
                    )
                except Exception as e:  # whatever the record holds: said, counted, passed
                    self._undecodable(endpoint, record, e)
                    skipped += 1
                    cursor = record.offset + 1
                    continue
                if last is not None and change.position <= last:  # CDC sent it again
                    cursor = record.offset + 1
                    continue
                message = message_for(
                    endpoint.id, endpoint.view, endpoint.filter, change, record.offset
                )
                if message is None:
                    cursor, last = record.offset + 1, change.position
                    continue
                write()  # the cursor up to this change, so a restart resumes right at it
                result = self._deliver(
                    session, endpoint, message, s.webhook_retry_window_s, failing, retrying
                )
                retrying = None
                failing = not result.delivered
                cursor, last = record.offset + 1, change.position
                if result.delivered:
                    write()
                else:
                    session.dead_letter(
                        message, result.attempts, result.error or "", result.first_attempt_at
                    )
                    written = (cursor, last)
                    log.warning(
                        "webhook %s: %s dead-lettered after %d attempts: %s",
                        endpoint.id,
                        message.id,
                        result.attempts,
                        result.error,
                    )
                if self.stopping.is_set():
                    return
            if time.monotonic() - written_at >= IDLE_CURSOR_WRITE_S or not records:
                write()

    def _undecodable(self, endpoint: Endpoint, record: Any, error: Exception) -> None:
        """A changelog record that cannot be decoded is logged and skipped (counted in the
        endpoint's `skipped_offsets`): retrying it could only fail again, and would hold every
        later change of the view."""
        log.error(
            "webhook %s: cannot decode the changelog record at %s:%d offset %d (%s: %s); skipped",
            endpoint.id,
            record.topic,
            record.partition,
            record.offset,
            type(error).__name__,
            error,
        )

    def _deliver(
        self,
        session: Session,
        endpoint: Endpoint,
        message: Message,
        window: float,
        failing: bool,
        retrying: Endpoint | None = None,
        replay: bool = False,
    ) -> Attempts:
        """POST `message` until a 2xx, or until the next attempt would fall outside `window`
        (counted from its first attempt, across restarts). Raises Stopped when told to stop,
        and when the endpoint has failed for longer than LOGFOLD_WEBHOOK_PAUSE_AFTER_S (after
        pausing it): the cursor then stays at this delivery."""
        s = self.settings
        since, attempts = datetime.now(UTC), 0
        if retrying is not None and retrying.retrying_offset == message.offset:
            since = retrying.retrying_since or since
            attempts = retrying.attempts
        while True:
            if self.stopping.is_set():
                raise Stopped
            session.ensure_active()
            body = message.body
            stamp = int(time.time())
            outcome = self.sender.post(
                endpoint.url, body, signing.headers(endpoint.secret, message.id, stamp, body)
            )
            attempts += 1
            if outcome.acknowledged:
                if failing:
                    session.delivered()
                return Attempts(True, attempts, None, since)
            error = outcome.error or "not acknowledged"
            failing = True
            failing_for = session.failed(None if replay else message.offset, since, attempts, error)
            if failing_for >= s.webhook_pause_after_s:
                reason = f"failing for {failing_for:.0f} s without a success; last error: {error}"
                session.pause(reason)
                log.warning("webhook %s: paused: %s", endpoint.id, reason)
                raise Stopped
            elapsed = (datetime.now(UTC) - since).total_seconds()
            wait = backoff.next_attempt_in(
                attempts,
                elapsed,
                window,
                s.webhook_backoff_base_s,
                s.webhook_backoff_cap_s,
                self.rng,
            )
            log.info(
                "webhook %s: %s attempt %d failed (%s); %s",
                endpoint.id,
                message.id,
                attempts,
                error,
                "giving up" if wait is None else f"next in {wait:.1f} s",
            )
            if wait is None:
                return Attempts(False, attempts, error, since)
            if self.stopping.wait(wait):
                raise Stopped

    def _replay(self, session: Session, endpoint: Endpoint, failing: bool) -> bool:
        """Deliver the dead letters marked for replay, oldest first, each retried within
        LOGFOLD_WEBHOOK_REPLAY_WINDOW_S; whether the endpoint is failing afterwards."""
        for letter in session.replays():
            result = self._deliver(
                session,
                endpoint,
                _message_of(letter),
                self.settings.webhook_replay_window_s,
                failing,
                replay=True,
            )
            failing = not result.delivered
            session.replayed(letter.message_id, result.delivered, result.attempts, result.error)
        return failing


def _message_of(letter: DeadLetter) -> Message:
    return Message(
        letter.message_id,
        letter.offset,
        WalPosition.parse(letter.position),
        letter.key,
        letter.body.encode(),
    )


def changelog_end(settings: Settings, view: str, timeout_s: float) -> int:
    """The end offset of `view`'s changelog now: where an endpoint registered now starts."""
    tp = TopicPartition(Topics(settings.topic_prefix).cdc(view), 0)
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        metrics_enabled=False,
        request_timeout_ms=int(timeout_s * 1000),
        client_id="logfold-webhooks-api",
        **kafka_consumer_options(),
    )
    try:
        return int(consumer.end_offsets([tp])[tp])
    finally:
        consumer.close()
