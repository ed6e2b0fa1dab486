"""While Kafka is away, the command processor starts a new session again and again: doubling
the wait in between up to a bound short enough that it finds Kafka soon after its return, and
logging the first failure of a run whole and the later ones as a line."""

from __future__ import annotations

import logging

import pytest
from kafka.errors import NoBrokersAvailable

import commands.processor
from commands.processor import SESSION_BACKOFF_MAX_S, CommandProcessor
from config.settings import Settings


def waits_until_stopped(
    monkeypatch: pytest.MonkeyPatch, processor: CommandProcessor, sessions: int
) -> list[float]:
    """The waits between `processor`'s sessions, recorded instead of waited; it is stopped
    at the `sessions`-th."""
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == sessions:
            processor.stop()
        return processor._stopping.is_set()

    monkeypatch.setattr(processor._stopping, "wait", wait)
    return waits


def test_sessions_failing_in_a_row_wait_doubling_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    processor = CommandProcessor(Settings(kafka_bootstrap_servers="nowhere:9", jwt_secret="x" * 32))
    sessions: list[int] = []

    def session() -> None:
        sessions.append(1)
        raise NoBrokersAvailable()

    monkeypatch.setattr(processor, "_session", session)
    waits = waits_until_stopped(monkeypatch, processor, 7)
    with caplog.at_level(logging.WARNING, logger=commands.processor.__name__):
        processor.run()

    assert len(sessions) == 7
    assert waits == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert max(waits) == SESSION_BACKOFF_MAX_S <= 2.0
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(with_traceback) == 1 and len(caplog.records) == 7


def test_a_session_that_reached_kafka_starts_the_waits_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    processor = CommandProcessor(Settings(kafka_bootstrap_servers="nowhere:9", jwt_secret="x" * 32))
    reached = iter([False, False, True, False])

    def session() -> None:
        processor._reached = next(reached)
        raise NoBrokersAvailable()

    monkeypatch.setattr(processor, "_session", session)
    waits = waits_until_stopped(monkeypatch, processor, 4)
    processor.run()
    assert waits == [0.5, 1.0, 0.5, 1.0]
