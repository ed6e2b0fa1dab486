"""kafka-python 2.x's transaction abort with a batch in flight (see `events.store`): the batch
sent and awaiting the broker is left to the broker's answer, the queued one is failed, and
stopping the sender then fails every batch left, so no future of the producer hangs."""

from __future__ import annotations

import time

from kafka import TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.producer.record_accumulator import RecordAccumulator

import events.store

TP = TopicPartition("logfold.events.book", 0)


def _sent(acc: RecordAccumulator) -> object:
    """What the sender's drain does to the oldest batch of TP: out of its queue, in flight."""
    batch = acc._batches[TP].popleft()
    batch.records.close()
    batch.drained = time.time()
    return batch


def test_aborting_a_transaction_skips_the_batch_in_flight_and_fails_the_queued_one() -> None:
    acc = RecordAccumulator(batch_size=64)
    in_flight = acc.append(TP, 0, b"k1", b"v" * 40, [])[0]
    _sent(acc)
    queued = acc.append(TP, 0, b"k2", b"v" * 40, [])[0]

    acc.abort_undrained_batches(KafkaError("transaction aborted"))

    assert not in_flight.is_done, "the batch in flight waits for the broker's answer"
    assert queued.is_done and queued.failed()
    assert not acc._batches[TP]


def test_stopping_the_sender_fails_every_batch_left_in_flight_or_queued() -> None:
    acc = RecordAccumulator(batch_size=64)
    in_flight = acc.append(TP, 0, b"k1", b"v" * 40, [])[0]
    _sent(acc)
    queued = acc.append(TP, 0, b"k2", b"v" * 40, [])[0]

    acc.abort_incomplete_batches()

    assert in_flight.is_done and in_flight.failed()
    assert queued.is_done and queued.failed()
    assert not acc.has_incomplete


class _StuckSender:
    def __init__(self) -> None:
        self.stopped = False

    def force_close(self) -> None:
        self.stopped = True

    def join(self, timeout: float | None = None) -> None:
        pass


class _StuckProducer:
    """A producer whose records are never acknowledged: close's flush times out."""

    def __init__(self) -> None:
        self._sender = _StuckSender()
        self.closes: list[float] = []

    def close(self, timeout: float | None = None) -> None:
        self.closes.append(timeout or 0)
        if not self._sender.stopped:
            raise KafkaTimeoutError("Timeout waiting for future")


def test_closing_a_producer_whose_sends_hang_stops_its_sender_and_returns() -> None:
    producer = _StuckProducer()

    events.store.close_within(producer, 0.5)  # type: ignore[arg-type]

    assert producer._sender.stopped
    assert producer.closes == [0.5, 0]
