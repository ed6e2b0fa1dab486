"""Log setup (config/logs.py): levels, what each level shows, text lines prefixed with their
process, and the relay of a child's output that `logfold run` prefixes and holds back while the
child stops; and `logfold run`'s minute line (stack/pulse.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from config import logs
from config.settings import Settings
from stack.pulse import Counts, line


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    """The root logger, and the quieted libraries' loggers, put back as they were after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in logs.QUIET}
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)


@pytest.mark.parametrize(
    ("name", "level"),
    [("debug", logging.DEBUG), ("INFO", logging.INFO), ("warn", logging.WARNING)],
)
def test_levels_are_spelled_any_case(name: str, level: int) -> None:
    assert logs.level_of(name) == level


def test_an_unknown_level_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValidationError, match="LOGFOLD_LOG_LEVEL"):
        Settings(log_level="loud")
    assert Settings().log_level == "info"


def test_spark_says_only_errors_unless_debugging() -> None:
    assert logs.spark_level("info") == "ERROR"
    assert logs.spark_level("warning") == "ERROR"
    assert logs.spark_level("debug") == "WARN"


def test_at_info_libraries_chatter_is_left_out_and_debug_brings_it(
    root: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("info", "text")
    logging.getLogger("commands.processor").info("claimed partition 2")
    logging.getLogger("kafka.conn").info("connecting to 127.0.0.1")
    logging.getLogger("alembic.runtime.migration").info("Running upgrade 0001 -> 0002")
    logging.getLogger("commands.processor").debug("polled 0 records")
    shown = capsys.readouterr().err
    assert "claimed partition 2" in shown
    assert "connecting" not in shown and "Running upgrade" not in shown
    assert "polled" not in shown

    logs.configure("debug", "text")
    logging.getLogger("kafka.conn").info("connecting to 127.0.0.1")
    logging.getLogger("commands.processor").debug("polled 0 records")
    shown = capsys.readouterr().err
    assert "connecting to 127.0.0.1" in shown and "polled 0 records" in shown


def test_json_is_one_object_a_line(
    root: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("info", "json")
    logging.getLogger("cdc.capture").warning("slot lost")
    doc = json.loads(capsys.readouterr().err.strip())
    assert (doc["level"], doc["logger"], doc["msg"]) == ("warning", "cdc.capture", "slot lost")


def test_text_lines_are_prefixed_with_their_process_every_line_of_them() -> None:
    formatter = logs.TextFormatter("run")
    record = logging.LogRecord("stack.local", logging.INFO, "", 0, "stopped %s", ("api",), None)
    assert formatter.format(record).startswith("run       | ")
    assert formatter.format(record).endswith(" INFO  stopped api")  # info: no logger name
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord(
            "app.errors", logging.ERROR, "", 0, "unhandled", (), sys.exc_info()
        )
    lines = formatter.format(failed).split("\n")
    assert lines[0].endswith("ERROR app.errors: unhandled")
    assert len(lines) > 2 and all(part.startswith("run       | ") for part in lines)


def relay(debug: bool, first: list[bytes], then: list[bytes]) -> tuple[list[str], list[str]]:
    """Relay `first`, then withhold (the child is being stopped) and relay `then`: what was
    shown, and what was held back."""
    read, write = os.pipe()
    shown: list[str] = []
    relayed = logs.Relay("projector", os.fdopen(read, "rb"), shown.append, debug=debug, keep=3)
    with os.fdopen(write, "wb", buffering=0) as pipe:  # the child's end
        for chunk in first:
            pipe.write(chunk)
        expected = len([c for c in first if debug or b"incubator" not in c])
        _wait_for(lambda: len(shown) >= expected)
        relayed.withhold()
        for chunk in then:
            pipe.write(chunk)
    relayed.join(5)  # the relay reads to the end, and closes its end
    return shown, relayed.held()


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_childs_lines_are_prefixed_and_its_stopping_noise_held_back() -> None:
    stack_trace = [b"ERROR Utils: Aborting task\n", *[b"\tat org.apache.Foo(F.java:1)\n"] * 5]
    shown, held = relay(
        False,
        [b"WARNING: Using incubator modules: jdk.incubator.vector\n", b"08:00:00 INFO  ready\n"],
        stack_trace,
    )
    assert shown == ["projector | 08:00:00 INFO  ready"]
    assert held == ["projector | \tat org.apache.Foo(F.java:1)"] * 3  # the last `keep`


def test_at_debug_a_child_shows_everything() -> None:
    shown, held = relay(
        True, [b"WARNING: Using incubator modules: jdk.incubator.vector\n"], [b"stopping\n"]
    )
    assert shown == [
        "projector | WARNING: Using incubator modules: jdk.incubator.vector",
        "projector | stopping",
    ]
    assert held == []


def test_the_minute_line_says_throughput_lag_and_what_is_down() -> None:
    health = {
        "components": {
            "command_processing": {"status": "up", "lag_events": 3},
            "projection:orders": {"status": "up", "lag_events": 5, "lag_seconds": 1.5},
            "projection:books": {"status": "up", "lag_events": 2, "lag_seconds": 0.25},
            "cdc": {"status": "down"},
        }
    }
    said = line(Counts(100, 1000), Counts(160, 1240), health)
    assert said == (
        "last minute: 60 commands, 240 view updates; lag: 3 commands, 7 events in views "
        "(1.5 s); down: cdc"
    )
    assert line(Counts(0, 0), Counts(1, 2), None).endswith("lag unknown (/health did not answer)")


def test_the_readme_shows_the_minute_line_as_run_prints_it() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    shown = next(x for x in readme.splitlines() if "last minute:" in x and x.startswith("run"))
    quiet = {"components": {"command_processing": {"status": "up", "lag_events": 0}}}
    said = line(Counts(0, 0), Counts(60, 240), quiet)
    record = logging.LogRecord("logfold", logging.INFO, "", 0, said, (), None)
    printed = logs.TextFormatter("run").format(record)
    assert shown[len("run       | 10:42:15") :] == printed[len("run       | 10:42:15") :]
