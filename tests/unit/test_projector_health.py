"""`/health`'s component `projector` from the projector's status row (spark/status.py): down
when silent for three beats or without a Spark executor, up otherwise with each query's mode;
absent when no projector runs, and gone from the monitor's components once its row is."""

from __future__ import annotations

from typing import Any

from app.health import HealthChecks, HealthMonitor, public
from config.settings import PROJECTOR_BEAT_S, Settings

ROW = {
    "name": "projector",
    "master": "spark://127.0.0.1:7077",
    "executors": 2,
    "slots": 24,
    "slots_needed": 22,
    "queries": {"events": {"mode": "real-time", "active": True}},
    "age_s": 1.0,
}


class Views:
    """Stands in for the read model: the status row the test sets (None: no projector)."""

    def __init__(self, row: dict[str, Any] | None) -> None:
        self.row = row

    def projector_status(self) -> dict[str, Any] | None:
        return self.row


def _projector(row: dict[str, Any] | None) -> dict[str, Any]:
    checks = HealthChecks(Settings(), read_model=Views(row))  # type: ignore[arg-type]
    return checks.projector()


def test_a_projector_with_executors_and_a_fresh_beat_is_up_and_shows_its_queries() -> None:
    shown = _projector(ROW)["projector"]
    assert shown["status"] == "up" and "error" not in shown
    assert shown["executors"] == 2 and shown["slots"] == 24 and shown["slots_needed"] == 22
    assert shown["queries"] == ROW["queries"]
    assert "master" not in public({"projector": shown})["projector"]  # (it names a host)


def test_a_projector_without_executors_is_down_saying_why() -> None:
    shown = _projector({**ROW, "executors": 0, "slots": 0})["projector"]
    assert shown["status"] == "down"
    assert "no Spark executor" in shown["error"]


def test_a_silent_projector_is_down_after_three_beats() -> None:
    assert _projector({**ROW, "age_s": 3 * PROJECTOR_BEAT_S - 1})["projector"]["status"] == "up"
    shown = _projector({**ROW, "age_s": 3 * PROJECTOR_BEAT_S + 1})["projector"]
    assert shown["status"] == "down" and "has not reported" in shown["error"]


def test_no_projector_no_component() -> None:
    assert _projector(None) == {}


def test_a_component_its_check_stops_reporting_is_dropped() -> None:
    views = Views(ROW)
    checks = HealthChecks(Settings(), read_model=views)  # type: ignore[arg-type]

    class Only:
        timeout = 1.0

        def checks(self) -> dict[str, Any]:
            return {"projector": checks.projector}

        def reset(self) -> None:
            pass

    monitor = HealthMonitor(Only(), interval=0.01)  # type: ignore[arg-type]
    monitor.round()
    assert monitor.snapshot()["projector"]["status"] == "up"
    views.row = None  # stopped on purpose: its row removed
    monitor.round()
    assert "projector" not in monitor.snapshot()
