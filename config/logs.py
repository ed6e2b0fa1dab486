"""Every Logfold process's log setup, in one place.

`LOGFOLD_LOG_LEVEL` (`info` by default) sets what a process shows. At `info`: what an operator
needs (start, ready, errors, and from `logfold run` one line a minute of throughput and lag);
the libraries' chatter (kafka-python, py4j, alembic), Spark's own warnings and what a process
prints while it is being stopped are left out. `debug` brings all of that back.
`LOGFOLD_LOG_FORMAT`: `json` (one object per line on stderr, for a log collector) or `text` (for
a person; what `logfold run` gives its processes). `logfold run` prefixes each line of its
processes with the process's name (`Relay`)."""

from __future__ import annotations

import collections
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import IO

# Loggers of libraries that say too much for an operator at info, and what they show then. At
# debug they show info, not their own debug: kafka-python's debug is every request it sends.
QUIET = {
    "kafka": logging.WARNING,  # at info, every connection it opens
    "kafka.coordinator.consumer": logging.ERROR,
    "py4j": logging.WARNING,  # every callback from the JVM (each Spark micro-batch)
    "alembic": logging.WARNING,  # each migration script, at every start
}
# Lines a process prints outside its logging that say nothing to an operator: the JVM's note
# that Spark uses an incubating module (Spark adds it to the JVM's options).
NOISE = re.compile(r"WARNING: Using incubator modules")
NAME_WIDTH = 9  # "processor"; longer names push their line along


LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}


def level_of(name: str) -> int:
    """The logging level `name` spells (`debug`, `INFO`, `warn`, …); ValueError otherwise."""
    try:
        return LEVELS[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {name!r}: use {', '.join(LEVELS)} (LOGFOLD_LOG_LEVEL)"
        ) from None


def is_debug(name: str) -> bool:
    return level_of(name) <= logging.DEBUG


def spark_level(name: str) -> str:
    """The log4j level of a process's Spark at log level `name`: its warnings (about scheduler
    pools, plans it shortens, settings it ignores) are for debugging Logfold, not running it."""
    return "WARN" if is_debug(name) else "ERROR"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class TextFormatter(logging.Formatter):
    """`12:00:01 INFO  claimed partition 2 at offset 17`, optionally after the process's name
    (`run       | …`); a record at another level than info names its logger too
    (`12:00:02 ERROR app.errors: unhandled error`)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.prefix = prefix(process) if process else ""

    def format(self, record: logging.LogRecord) -> str:
        at = time.strftime("%H:%M:%S", time.localtime(record.created))
        where = "" if record.levelno == logging.INFO else f"{record.name}: "
        line = f"{at} {record.levelname:<5} {where}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return "\n".join(self.prefix + part for part in line.split("\n"))


def prefix(process: str) -> str:
    return f"{process:<{NAME_WIDTH}} | "


def configure(level: str = "INFO", fmt: str = "json", process: str | None = None) -> None:
    """Send this process's logs to stderr at `level`, as `fmt` (`json` or `text`; `process`
    prefixes text lines with its name)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter(process) if fmt == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_of(level))
    for name, quiet in QUIET.items():
        logging.getLogger(name).setLevel(logging.INFO if is_debug(level) else quiet)


class Relay:
    """Copies a child process's output (stdout and stderr together) to `out`, each line
    prefixed with the child's name, until the child closes it (its own children too: a JVM
    that pyspark started writes to the same pipe).

    `withhold()`, called when the child is being stopped, keeps its further lines back (the
    last `keep` of them, for `held()`): what a process prints while it stops (Spark's tasks
    interrupted mid-fetch, with their Java stacks) is expected, and shown only at debug."""

    def __init__(
        self,
        name: str,
        stream: IO[bytes],
        out: Callable[[str], object],
        debug: bool = False,
        keep: int = 20,
    ) -> None:
        self.name, self.stream, self.out, self.debug = name, stream, out, debug
        self._held: collections.deque[str] = collections.deque(maxlen=keep)
        self._withheld = False
        self._thread = threading.Thread(target=self._copy, name=f"relay-{name}", daemon=True)
        self._thread.start()

    def withhold(self) -> None:
        self._withheld = not self.debug

    def held(self) -> list[str]:
        """The last lines kept back since `withhold()`, prefixed."""
        return list(self._held)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _copy(self) -> None:
        for line in self._lines(self.stream):
            if NOISE.search(line) and not self.debug:
                continue
            shown = prefix(self.name) + line
            if self._withheld:
                self._held.append(shown)
            else:
                self.out(shown)

    @staticmethod
    def _lines(stream: IO[bytes]) -> Iterable[str]:
        with stream:
            for raw in stream:
                yield raw.decode(errors="replace").rstrip("\r\n")
