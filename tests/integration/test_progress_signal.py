"""Readers waiting for a position (read-your-writes) wake when progress is written: Postgres
notifies at the commit (migration 0011) and the API's `ProgressSignal` listens; without it they
poll. Real Postgres, no Kafka records needed: progress rows are written as a projector would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import app.waiting as app_waiting
from app.read_model import ReadModel
from app.waiting import ProgressSignal
from commands.messages import LogPosition
from config.settings import Settings
from config.topics import Topics
from projections.registry import FOLDS
from stack.procs import free_port, wait_until
from tests.support import fill_log, new_deployment


@pytest.fixture
def deployment(base_settings: Settings) -> Settings:
    settings = new_deployment(base_settings)
    fill_log(settings, Topics(settings.topic_prefix).events("customer"), 1, 10)
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        conn.execute("INSERT INTO projection_progress (projection) VALUES ('customers')")
    return settings


@pytest.fixture
def model(deployment: Settings) -> Iterator[ReadModel]:
    model = ReadModel(deployment)
    yield model
    model.close()
    model.engine.dispose()


def position(settings: Settings) -> LogPosition:
    return LogPosition(Topics(settings.topic_prefix).events("customer"), 0, 5)


def apply_up_to(settings: Settings, at: LogPosition) -> None:
    """What a projector's batch does to the progress of `customers`, committed."""
    with psycopg.connect(settings.database()) as conn:
        conn.execute(
            "UPDATE projection_progress SET offsets = %s WHERE projection = 'customers'",
            (Jsonb({f"{at.topic}:{at.partition}": at.offset}),),
        )


def waiting(model: ReadModel, at: LogPosition) -> tuple[threading.Thread, list[bool]]:
    answer: list[bool] = []
    thread = threading.Thread(
        target=lambda: answer.append(model.wait_for(FOLDS["customers"], at, 120)), daemon=True
    )
    thread.start()
    return thread, answer


def test_a_reader_waiting_for_a_position_wakes_when_progress_is_written(
    deployment: Settings, model: ReadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between signals, a waiter would look again only after ten minutes: only the
    # notification can wake it within the test's bounds.
    monkeypatch.setattr(app_waiting, "SIGNALLED_POLL_S", 600.0)
    waits = threading.Event()
    real_wait = ProgressSignal.wait

    def wait(self: ProgressSignal, seen: int, timeout: float) -> None:
        waits.set()
        real_wait(self, seen, timeout)

    monkeypatch.setattr(ProgressSignal, "wait", wait)
    at = position(deployment)
    thread, answer = waiting(model, at)
    wait_until(waits.is_set, 30, "the reader to wait for a signal")
    assert thread.is_alive() and not answer  # the view does not include the position yet

    apply_up_to(deployment, at)
    thread.join(timeout=30)
    assert answer == [True]


def test_readers_poll_while_the_signal_cannot_listen(
    deployment: Settings, model: ReadModel
) -> None:
    model.signal.close()
    model.signal = ProgressSignal(f"postgresql://nobody@127.0.0.1:{free_port()}/none")
    at = position(deployment)
    thread, answer = waiting(model, at)
    wait_until(lambda: model.signal.seen() > 1, 30, "the signal to fail to listen, twice")
    assert not model.signal.listening and thread.is_alive()

    apply_up_to(deployment, at)
    thread.join(timeout=30)
    assert answer == [True]


def test_one_notification_per_transaction_however_many_progress_rows(
    deployment: Settings,
) -> None:
    with psycopg.connect(deployment.database(), autocommit=True) as listener:
        listener.execute("LISTEN logfold_progress")
        with psycopg.connect(deployment.database()) as conn:
            conn.execute("INSERT INTO projection_progress (projection) VALUES ('books')")
            for name in ("customers", "books"):
                conn.execute(
                    "UPDATE projection_progress SET events_applied = 1 WHERE projection = %s",
                    (name,),
                )
        got: list[Any] = list(listener.notifies(timeout=2.0))
        assert [n.channel for n in got] == ["logfold_progress"]
        with psycopg.connect(deployment.database()) as conn:  # nothing written, nothing said
            conn.execute("SELECT * FROM projection_progress FOR UPDATE")
        assert list(listener.notifies(timeout=1.0)) == []
