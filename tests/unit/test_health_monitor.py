"""The health monitor (guarantee 17): checks in the background, one at a time, each bounded;
a component that was up is down only after consecutive failures; errors only for admins."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from app.health import HealthMonitor, public


class Checks:
    """Stands in for HealthChecks: each check answers what the test scripts."""

    def __init__(self, timeout: float = 0.2) -> None:
        self.timeout = timeout
        self.script: dict[str, Callable[[], dict[str, Any]]] = {
            "kafka": lambda: {"status": "up", "brokers": 1},
            "postgres": lambda: {"status": "up"},
        }
        self.calls: list[str] = []
        self.resets = 0
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def checks(self) -> dict[str, Callable[[], dict[str, dict[str, Any]]]]:
        def each(name: str) -> Callable[[], dict[str, dict[str, Any]]]:
            def check() -> dict[str, dict[str, Any]]:
                with self._lock:
                    self.calls.append(name)
                    self.running += 1
                    self.most_running = max(self.most_running, self.running)
                try:
                    return {name: self.script[name]()}
                finally:
                    with self._lock:
                        self.running -= 1

            return check

        return {name: each(name) for name in self.script}

    def reset(self) -> None:
        self.resets += 1


def broken() -> dict[str, Any]:
    raise ConnectionError("kafka at 10.0.0.7:9092 refused the connection")


def test_an_up_component_is_down_only_after_consecutive_failures() -> None:
    checks = Checks()
    monitor = HealthMonitor(checks, interval=60, failures=3)  # type: ignore[arg-type]
    monitor.round()
    assert monitor.snapshot()["kafka"]["status"] == "up"

    checks.script["kafka"] = broken
    monitor.round()
    monitor.round()
    shown = monitor.snapshot()["kafka"]
    assert shown["status"] == "up" and shown["brokers"] == 1  # the last good answer, aging
    monitor.round()
    shown = monitor.snapshot()["kafka"]
    assert shown["status"] == "down" and "refused" in shown["error"]
    assert checks.resets >= 3  # a failed check drops the kept clients

    checks.script["kafka"] = lambda: {"status": "up", "brokers": 1}
    monitor.round()
    assert monitor.snapshot()["kafka"]["status"] == "up"  # back at the first good answer


def test_a_failure_between_successes_does_not_count_towards_down() -> None:
    checks = Checks()
    monitor = HealthMonitor(checks, interval=60, failures=2)  # type: ignore[arg-type]
    good = checks.script["kafka"]
    for script in (good, broken, good, broken, good):
        checks.script["kafka"] = script
        monitor.round()
        assert monitor.snapshot()["kafka"]["status"] == "up"


def test_a_component_first_seen_down_is_shown_down_at_once() -> None:
    checks = Checks()
    checks.script["kafka"] = broken
    monitor = HealthMonitor(checks, interval=60, failures=3)  # type: ignore[arg-type]
    monitor.round()
    assert monitor.snapshot()["kafka"]["status"] == "down"


def test_a_check_that_does_not_answer_is_bounded_and_not_started_twice() -> None:
    checks = Checks(timeout=0.2)
    release = threading.Event()

    def hangs() -> dict[str, Any]:
        release.wait(30)
        return {"status": "up"}

    checks.script["postgres"] = hangs
    monitor = HealthMonitor(checks, interval=60, failures=1)  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        monitor.round()
        assert time.monotonic() - started < 5  # the round went on without it
        shown = monitor.snapshot()["postgres"]
        assert shown["status"] == "down" and "no answer in 0.2s" in shown["error"]
        monitor.round()
        assert "has not answered" in monitor.snapshot()["postgres"]["error"]
        assert checks.calls.count("postgres") == 1  # still running: not started again
        assert checks.calls.count("kafka") == 2 and checks.most_running <= 2
    finally:
        release.set()


def test_checks_run_one_at_a_time_in_the_background_and_requests_only_read() -> None:
    checks = Checks()
    monitor = HealthMonitor(checks, interval=0.05, failures=1)  # type: ignore[arg-type]
    monitor.start()
    monitor.start()  # idempotent: one thread
    try:
        first = monitor.snapshot(wait=10)
        assert {"kafka", "postgres"} <= set(first)
        assert all(c["age_seconds"] >= 0 for c in first.values())
        calls = len(checks.calls)
        for _ in range(100):
            monitor.snapshot()
        assert len(checks.calls) < calls + 50  # reading does not check
        assert checks.most_running == 1
    finally:
        monitor.stop()


def test_before_the_first_round_nothing_is_up() -> None:
    checks = Checks()
    started = threading.Event()

    def slow() -> dict[str, Any]:
        started.wait(5)
        return {"status": "up"}

    checks.script["kafka"] = slow
    monitor = HealthMonitor(checks, interval=60, failures=1)  # type: ignore[arg-type]
    monitor.start()
    try:
        shown = monitor.snapshot()
        assert shown == {"health_checks": {"status": "down", "error": "not checked yet"}}
    finally:
        started.set()
        monitor.stop()


def test_unauthenticated_callers_see_statuses_without_error_texts() -> None:
    components = {
        "kafka": {"status": "down", "error": "10.0.0.7:9092 refused", "age_seconds": 1.0},
        "cdc": {"status": "up", "lag_bytes": 0},
    }
    shown = public(components)
    assert shown == {
        "kafka": {"status": "down", "age_seconds": 1.0},
        "cdc": {"status": "up", "lag_bytes": 0},
    }
    assert "error" in components["kafka"]  # the caller's copy is untouched
