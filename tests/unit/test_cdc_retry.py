"""While Postgres or Kafka is away, CDC starts streaming from its slot again and again: doubling
the wait in between up to a bound short enough that the changelogs resume soon after the
dependency's return, and starting the waits over after a session that did stream."""

from __future__ import annotations

import pytest

import cdc.capture
from cdc.capture import RETRY_MAX_S, Capture
from config.settings import Settings


def run_failing(monkeypatch: pytest.MonkeyPatch, streamed: list[bool]) -> list[float]:
    """The waits between the sessions of a capture whose sessions fail, each after streaming
    or not as `streamed` says; it is stopped at the last."""
    monkeypatch.setattr(cdc.capture, "prepare", lambda *_: None)
    capture = Capture(Settings(database_url="postgresql://nowhere/x"))
    sessions = iter(streamed)

    def stream() -> None:
        capture.streaming = next(sessions)
        raise OSError("connection refused")

    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == len(streamed):
            capture.stop()
        return capture._stopping.is_set()

    monkeypatch.setattr(capture, "_stream", stream)
    monkeypatch.setattr(capture._stopping, "wait", wait)
    capture.run()
    assert capture.failures == len(streamed)
    return waits


def test_sessions_failing_in_a_row_wait_doubling_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = run_failing(monkeypatch, [False] * 6)
    assert waits == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert max(waits) == RETRY_MAX_S <= 2.0


def test_a_session_that_streamed_starts_the_waits_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # Failures hours apart, each ending a stream: each waits the first wait, not a longer one.
    assert run_failing(monkeypatch, [True, True, True]) == [0.5, 0.5, 0.5]
    assert run_failing(monkeypatch, [False, False, True, False]) == [0.5, 1.0, 0.5, 1.0]
