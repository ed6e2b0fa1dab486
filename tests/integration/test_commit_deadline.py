"""A 504 is never applied after all (guarantees 1 and 4). While clients send commands without
an Idempotency-Key, the broker is frozen with SIGSTOP again and again, each time for longer than
the commands in flight have left until their deadlines, and resumed. Every command answered 504
must be absent from the log: a client that retries it without a key would otherwise get it twice.
For that, the API waits until a commit asked for in time has been acknowledged (the freezes are
shorter than `kafka_timeout_s`, the longest a processor waits for that), and a processor never
asks for a commit past a deadline (the last test)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask import Flask
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata

from app import close_app, create_app
from commands.messages import CommandMessage, Reply
from commands.processor import (
    CommandProcessor,
    Expired,
    PartitionOwner,
    References,
    SnapshotReplica,
)
from config.settings import Settings
from config.topics import Topics
from events.partitioning import partition_for
from events.store import abort_within, read_to_end
from stack.local_kafka import LocalKafka
from stack.procs import wait_until
from stack.topics import create_topics
from tests.support import log_of, new_deployment, token

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {token(subject='deadline')}"}
THREADS = 8
FREEZES = 3
TIMEOUT_S = 1.5  # each command's deadline, after the API sends it


class Registrations:
    """THREADS clients registering customers without an Idempotency-Key until stopped, each
    customer's name unique; the answer to each command, by name."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.answers: dict[str, int] = {}
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,)) for i in range(THREADS)]
        for t in self._threads:
            t.start()

    def _send(self, worker: int) -> None:
        client = self.app.test_client()
        n = 0
        while not self._stopping.is_set():
            name = f"w{worker}-{n}"
            n += 1
            body = {"data": {"name": name, "email": f"{name}@example.com"}}
            r = client.post("/commands/register-customer", json=body, headers=AUTH)
            self.answers[name] = r.status_code

    def committed(self) -> int:
        return sum(1 for s in list(self.answers.values()) if s == 201)

    def flowing(self) -> None:
        """Until every client has had a command committed, give or take."""
        before = self.committed()
        wait_until(lambda: self.committed() >= before + THREADS, 90, "commands to commit")

    def stop(self) -> None:
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a request got no answer"


def freeze_again_and_again(proc: subprocess.Popen[bytes], load: Registrations, s: float) -> None:
    for _ in range(FREEZES):
        load.flowing()
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(s)  # the fault itself, not a wait for a condition
        finally:
            proc.send_signal(signal.SIGCONT)
    load.flowing()


def assert_no_504_applied(settings: Settings, answers: dict[str, int], frozen: str) -> None:
    statuses = Counter(answers.values())
    print(f"\n{len(answers)} commands, {FREEZES} freezes of the {frozen}: {dict(statuses)}")
    timed_out = {name for name, s in answers.items() if s == 504}
    # The freezes stall commands past their deadlines: this is what the test is about.
    assert timed_out, f"no command was answered 504: {dict(statuses)}"
    log = Counter(e.data["name"] for e in log_of(settings, "customer"))
    applied = sorted(name for name in timed_out if name in log)
    assert not applied, (
        f"{len(applied)} of {len(timed_out)} commands answered 504 were applied after all: "
        f"{applied[:10]}"
    )
    created = [name for name, s in answers.items() if s == 201]
    assert all(log[name] == 1 for name in created), "a command answered 201 not in the log once"


def test_a_frozen_broker_never_applies_a_command_answered_504(
    own_broker: LocalKafka, base_settings: Settings
) -> None:
    settings = base_settings.model_copy(
        update={
            "kafka_bootstrap_servers": own_broker.bootstrap,
            "command_timeout_s": TIMEOUT_S,
            "clock_skew_s": 0.0,  # one machine: one clock
            "kafka_timeout_s": 8.0,
        }
    )
    create_topics(settings)
    processor = CommandProcessor(settings)
    processing = threading.Thread(target=processor.run, name="processor", daemon=True)
    processing.start()
    app = create_app(settings)
    assert own_broker.proc is not None
    load = Registrations(app)
    try:
        # Longer than a deadline and 1 s; shorter than `kafka_timeout_s`.
        freeze_again_and_again(own_broker.proc, load, 4.0)
    finally:
        load.stop()
        # Nothing commits after this: whatever the processor had in flight is resolved.
        processor.stop()
        processing.join(timeout=60)
        close_app(app)
    assert_no_504_applied(settings, load.answers, "broker")


def registration(settings: Settings, name: str) -> tuple[CommandMessage, ConsumerRecord]:
    """A `register-customer` command for a new customer `name`, in the commands topic: the
    message and its record, as a processor would poll it."""
    topics = Topics(settings.topic_prefix)
    aggregate_id = f"customer-{name}"
    p = partition_for(aggregate_id, settings.partitions)
    msg = CommandMessage(
        command_id=str(uuid.uuid4()),
        name="register-customer",
        aggregate_type="customer",
        aggregate_id=aggregate_id,
        expected_version=None,
        data={"name": name, "email": f"{name}@example.com"},
        reply_to=f"api-{name}",
        deadline=time.time() + 5.0,  # ample time to be decided in
        correlation_id=str(uuid.uuid4()),
        subject="tester",
    )
    producer = KafkaProducer(bootstrap_servers=settings.kafka())
    producer.send(topics.commands, msg.encode(), aggregate_id.encode(), partition=p).get(30)
    producer.close()
    [record] = read_to_end(settings.kafka(), topics.commands, [p])
    return msg, record


@contextmanager
def owning(settings: Settings, partition: int) -> Iterator[tuple[PartitionOwner, References]]:
    """A processor's owner of `partition` (fenced and restored), with the references its
    decisions read; both closed afterwards."""
    topics = Topics(settings.topic_prefix)
    owner = PartitionOwner(settings, topics, partition)
    replica = SnapshotReplica(settings.kafka(), topics.snapshots)
    try:
        yield owner, References({partition: owner}, replica, settings.partitions)
    finally:
        owner.close()
        replica.close()


def test_a_processor_never_asks_to_commit_past_a_deadline(base_settings: Settings) -> None:
    """A command decided in time whose records are acknowledged only past its deadline (a
    stall the freezes above cannot make alone: a longer one times the requests out): its
    transaction is aborted, not committed, and the command, decided again, expires."""
    settings = new_deployment(base_settings)
    topics = Topics(settings.topic_prefix)
    msg, record = registration(settings, f"late-{uuid.uuid4().hex[:8]}")
    with owning(settings, record.partition) as (owner, refs):
        flush = owner.producer.flush

        def slow_flush(timeout: float | None = None) -> None:
            flush(timeout)
            time.sleep(max(msg.deadline - time.time(), 0) + 0.1)  # the stall itself

        owner.producer.flush = slow_flush
        with pytest.raises(Expired):
            owner.process([record], refs)
    assert not log_of(settings, "customer")

    processor = CommandProcessor(settings)
    processing = threading.Thread(target=processor.run, name="processor", daemon=True)
    processing.start()
    replies = partition_for(msg.reply_to, settings.partitions)
    answers: list[Reply] = []

    def answered() -> bool:
        answers[:] = [
            reply
            for r in read_to_end(settings.kafka(), topics.replies, [replies])
            for reply in Reply.decode_many(r.value)
            if reply.command_id == msg.command_id
        ]
        return bool(answers)

    try:
        wait_until(answered, 60, "the command to be decided again")
    finally:
        processor.stop()
        processing.join(timeout=60)
    assert [a.status for a in answers] == [504], answers
    assert not log_of(settings, "customer")


def test_a_send_that_failed_alone_fails_its_transaction(base_settings: Settings) -> None:
    """kafka-python can fail one send without failing the transaction (a send refused before
    it was queued, an unknown producer id): a transaction whose snapshot was never written
    must not commit its events, or a restart would decide from the older snapshot."""
    settings = new_deployment(base_settings)
    topics = Topics(settings.topic_prefix)
    _, record = registration(settings, f"lost-{uuid.uuid4().hex[:8]}")
    with owning(settings, record.partition) as (owner, refs):
        send = owner.producer.send

        def losing_snapshots(topic: str, *args: Any, **kwargs: Any) -> Any:
            if topic != topics.snapshots:
                return send(topic, *args, **kwargs)
            # What kafka-python's own `send` returns for a record it could not queue.
            lost = FutureRecordMetadata(FutureProduceResult(None), -1, None, None, -1, -1, -1)
            return lost.failure(KafkaError("the snapshot was lost"))

        owner.producer.send = losing_snapshots  # type: ignore[method-assign]
        with pytest.raises(KafkaError, match="the snapshot was lost"):
            owner.process([record], refs)
    assert not log_of(settings, "customer")
    assert not list(read_to_end(settings.kafka(), topics.snapshots, [record.partition]))


def test_an_abort_the_coordinator_does_not_answer_is_given_up_not_waited_for(
    own_broker: LocalKafka,
) -> None:
    """kafka-python waits for an abort without limit; a processor whose transaction failed
    because its coordinator's broker went away would then hold its partitions (and its group's
    rebalance) for ever. `abort_within` gives up after its timeout, and stops the producer."""
    topic = f"abort-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=own_broker.bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    producer = KafkaProducer(
        bootstrap_servers=own_broker.bootstrap,
        transactional_id=f"abort-{uuid.uuid4().hex[:8]}",
        max_block_ms=5000,
    )
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(topic, b"x").get(30)
    assert own_broker.proc is not None
    own_broker.proc.send_signal(signal.SIGSTOP)
    outcome: list[BaseException | None] = []

    def abort() -> None:
        try:
            abort_within(producer, 2.0)
            outcome.append(None)
        except BaseException as e:  # what it raised is the test's subject
            outcome.append(e)

    try:
        aborting = threading.Thread(target=abort, daemon=True)
        aborting.start()
        aborting.join(60)
        assert not aborting.is_alive(), "abort_within waited past its timeout"
        assert isinstance(outcome[0], KafkaTimeoutError), outcome
    finally:
        own_broker.proc.send_signal(signal.SIGCONT)
        producer.close(timeout=5)
