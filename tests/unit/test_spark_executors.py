"""A session on a cluster's master waits for its first executor, and while the executors
registered give fewer task slots than it needs, for more, until none has come for a while: the
projector counts the slots of every worker that is up, not of the first one whose executor
registered (the cluster test's failure when one worker's came seconds after the other's)."""

from __future__ import annotations

from typing import Any

import pytest

from spark import session
from spark.session import wait_for_executors


class Cluster:
    """What `wait_for_executors` asks of a SparkSession: its master, its task slots, and the
    executors registered, one more at each look named in `arrivals` (counted, not timed)."""

    def __init__(self, arrivals: list[int], cores: int = 12, master: str = "spark://h:7077"):
        self.arrivals, self.cores, self.master = arrivals, cores, master
        self.looks = 0

    @property
    def sparkContext(self) -> Cluster:
        return self

    @property
    def _jsc(self) -> Cluster:
        return self

    def sc(self) -> Cluster:
        return self

    @property
    def registered(self) -> int:
        return sum(1 for a in self.arrivals if a <= self.looks)

    def getExecutorMemoryStatus(self) -> Cluster:
        self.looks += 1
        return self

    def size(self) -> int:
        return self.registered + 1  # the driver too

    @property
    def defaultParallelism(self) -> int:
        return max(self.registered * self.cores, 2)


class Clock:
    """spark.session's `time`: its sleeps move the clock, at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(session, "time", fake)
    return fake


def wait(clock: Clock, cluster: Any, timeout_s: float, slots: int) -> tuple[bool, float]:
    began = clock.now
    came = wait_for_executors(cluster, timeout_s, slots)
    return came, clock.now - began


def test_it_waits_for_the_second_executor_when_the_first_gives_too_few_slots(
    clock: Clock,
) -> None:
    cluster = Cluster(arrivals=[2, 30])  # (a look every 0.1 s: the second 2.8 s after)
    came, _ = wait(clock, cluster, 30, slots=22)
    assert came and cluster.registered == 2


def test_the_first_executor_is_enough_when_it_gives_the_slots(clock: Clock) -> None:
    cluster = Cluster(arrivals=[2, 40], cores=22)
    came, _ = wait(clock, cluster, 30, slots=22)
    assert came and cluster.registered == 1


def test_with_too_few_slots_for_good_it_goes_on_once_none_has_come_for_a_while(
    clock: Clock,
) -> None:
    cluster = Cluster(arrivals=[1], cores=4)
    came, took = wait(clock, cluster, 30, slots=22)
    assert came and cluster.registered == 1
    assert took == pytest.approx(session.EXECUTORS_SETTLE_S, abs=0.2)  # not the 30-s bound


def test_without_any_executor_it_goes_on_after_its_bound(clock: Clock) -> None:
    came, took = wait(clock, Cluster(arrivals=[]), 30, slots=22)
    assert not came and took == pytest.approx(30, abs=0.2)


def test_a_local_master_does_not_wait(clock: Clock) -> None:
    cluster = Cluster(arrivals=[], master="local[4]")
    came, _ = wait(clock, cluster, 30, slots=22)
    assert came and cluster.looks == 0
