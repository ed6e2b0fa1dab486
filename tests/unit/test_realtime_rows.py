"""The real-time query's rows, as the projector reads them from its rows topic: only those of
the query running now, each source record's once (real-time mode delivers at least once), and
gathered into a transaction per interval at most under load."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from config.settings import IDLE_POLL_MS
from spark.realtime import GATHER_FETCH_MS, Pace, gather, rows_of

WIDTH = 8  # the position columns and one output


def record(generation: str, topic: str, partition: int, offset: int, rows: str) -> bytes:
    position = [topic, partition, offset, True, f"e{offset}", offset * 10, 0]
    return json.dumps(
        {"g": generation, **{str(i): v for i, v in enumerate([*position, rows])}}
    ).encode()


def offsets(rows: list[list[Any]]) -> list[tuple[str, int, int]]:
    return [(r[0], r[1], r[2]) for r in rows]


def test_a_replayed_epoch_in_the_same_poll_is_taken_once() -> None:
    values = [record("g1", "t", 0, o, "[]") for o in (5, 6, 7, 5, 6, 7, 8)]
    last: dict[str, int] = {}
    assert offsets(rows_of(values, "g1", WIDTH, last)) == [("t", 0, o) for o in (5, 6, 7, 8)]
    assert last == {"t:0": 8}


def test_a_replay_in_a_later_poll_is_taken_once_and_partitions_are_apart() -> None:
    last: dict[str, int] = {}
    rows_of([record("g1", "t", 0, 5, "[]"), record("g1", "t", 1, 9, "[]")], "g1", WIDTH, last)
    again = [record("g1", "t", 0, 4, "[]"), record("g1", "t", 0, 5, "[]")]
    again += [record("g1", "t", 1, 10, "[]"), record("g1", "u", 0, 1, "[]")]
    assert offsets(rows_of(again, "g1", WIDTH, last)) == [("t", 1, 10), ("u", 0, 1)]


def test_rows_of_another_query_start_are_not_taken() -> None:
    values = [record("old", "t", 0, 6, '[{"name": "Mallory"}]'), record("g2", "t", 0, 6, "[]")]
    taken = rows_of(values, "g2", WIDTH, {})
    assert offsets(taken) == [("t", 0, 6)] and taken[0][7] == "[]"


class Polls:
    """A consumer whose polls return the given batches in turn (then nothing), noting each
    poll's timeout."""

    def __init__(self, *batches: list[bytes]) -> None:
        self.batches = list(batches)
        self.timeouts: list[int] = []

    def poll(self, timeout_ms: int) -> dict[str, list[Any]]:
        self.timeouts.append(timeout_ms)
        batch = self.batches.pop(0) if self.batches else []
        return {"rows-0": [SimpleNamespace(value=v) for v in batch]}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Waits:
    def __init__(self, stopping: bool = False) -> None:
        self.waited: list[float] = []
        self.stopping = stopping

    def __call__(self, seconds: float) -> bool:
        self.waited.append(seconds)
        return self.stopping


def loaded(clock: Clock, per_s: float, seconds: float = 3.0) -> Pace:
    """A pace after `seconds` of transactions of one record each at `per_s`."""
    pace = Pace(interval=0.1, above_per_s=100, clock=clock)
    for _ in range(int(per_s * seconds)):
        pace.begin(1)
        clock.now += 1 / per_s
    return pace


def test_under_load_a_transaction_waits_for_its_interval_and_takes_what_came_meanwhile() -> None:
    clock = Clock()
    pace = loaded(clock, 400)
    assert pace.rate == pytest.approx(400, rel=0.05)
    pace.begin(1)
    clock.now += 0.02
    consumer, waits = Polls([b"a"], [b"b"], [b"c", b"d"]), Waits()
    assert gather(consumer, pace, waits) == [b"a", b"b", b"c", b"d"]  # type: ignore[arg-type]
    assert waits.waited == [pytest.approx(0.08)]
    assert consumer.timeouts == [IDLE_POLL_MS, 0, GATHER_FETCH_MS]


@pytest.mark.parametrize(
    ("per_s", "after", "interval"), [(50, 0.01, 0.1), (400, 0.15, 0.1), (400, 0.01, 0.0)]
)
def test_slow_records_late_ones_or_no_interval_go_at_once(
    per_s: float, after: float, interval: float
) -> None:
    """Records slower than the pace's rate, or later than its interval after the last
    transaction, or with no interval, do not wait."""
    clock = Clock()
    pace = loaded(clock, per_s)
    pace.interval = interval
    pace.begin(1)
    clock.now += after
    consumer, waits = Polls([b"a"], [b"b"]), Waits()
    taken = gather(consumer, pace, waits)  # type: ignore[arg-type]
    assert (taken, waits.waited, len(consumer.timeouts)) == ([b"a"], [], 1)


def test_a_burst_is_forgotten_within_seconds() -> None:
    clock = Clock()
    pace = loaded(clock, 1000, seconds=1)
    clock.now += 3
    pace.begin(1)
    assert pace.rate < 100 and pace.wait() == 0


def test_an_idle_poll_does_not_wait_and_a_stop_during_the_wait_ends_it() -> None:
    clock = Clock()
    pace = loaded(clock, 400)
    pace.begin(1)
    consumer, waits = Polls(), Waits()
    assert gather(consumer, pace, waits) == []  # type: ignore[arg-type]
    assert waits.waited == [] and consumer.timeouts == [IDLE_POLL_MS]
    consumer, waits = Polls([b"a"], [b"b"]), Waits(stopping=True)
    assert gather(consumer, pace, waits) == [b"a"]  # type: ignore[arg-type]
    assert len(consumer.timeouts) == 1
