"""Waiting for a position (read-your-writes): until a fold's progress includes it (woken by
Postgres's notification of each progress write), or the CDC slot has confirmed a WAL position
(one thread per process looks, for every waiter); and how many may wait at once."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import psycopg

from config.retry import Backoff
from projections.base.progress import CHANNEL

log = logging.getLogger(__name__)

POLL_S = 0.05  # between looks, with nothing to say when to look again
SIGNALLED_POLL_S = 1.0  # between looks while progress is signalled (in case one is missed)


class ProgressSignal:
    """Says when any fold's progress was written: Postgres notifies `CHANNEL` at the commit of
    every transaction that writes progress rows (a trigger, migration 0011), which a thread of
    its own LISTENs for on a connection of its own, started at the first use. While it cannot
    listen (Postgres down, the connection lost), `listening` is False and waiters poll."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.listening = False
        self._generation = 0  # notifications seen (and reconnections: one may have been missed)
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def seen(self) -> int:
        """What has been signalled so far, for `wait`."""
        with self._changed:
            if self._thread is None and not self._stopping.is_set():
                self._thread = threading.Thread(
                    target=self._listen, name="progress-signal", daemon=True
                )
                self._thread.start()
            return self._generation

    def wait(self, seen: int, timeout: float) -> None:
        """Until something is signalled after `seen`, or for `timeout` s."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen, max(timeout, 0.0))

    def close(self) -> None:
        self._stopping.set()
        with self._changed:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _signal(self, listening: bool) -> None:
        with self._changed:
            self.listening = listening
            self._generation += 1
            self._changed.notify_all()

    def _listen(self) -> None:
        backoff = Backoff(0.5, 5.0)
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=3) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._signal(listening=True)  # what changed before is looked at again
                    backoff.reset()
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self._signal(listening=True)
            except Exception as e:  # whatever it was, waiters poll until it listens again
                if self.listening:
                    log.warning("not listening for progress (%s); waiters poll", e)
                self._signal(listening=False)
                self._stopping.wait(backoff.next())
        self._signal(listening=False)


def poll_until(
    check: Callable[[], bool], deadline: float, signal: ProgressSignal | None = None
) -> bool:
    """Whether `check()` became true before `deadline` (time.monotonic): looked at again each
    time `signal` says progress was written (and at least every second), or every 50 ms while
    there is no signal to wait for."""
    while True:
        seen = signal.seen() if signal is not None else 0
        if check():
            return True
        left = deadline - time.monotonic()
        if left < 0:
            return False
        if signal is not None and signal.listening:
            signal.wait(seen, min(SIGNALLED_POLL_S, left))
        else:
            time.sleep(POLL_S)


class TooManyWaiters(Exception):
    """The process, or the token's subject, has as many reads waiting as it may."""


class Waiters:
    """Reads and subscriptions waiting for a position at once: each holds a server thread
    (and, while it polls, a database connection now and then), so at most `max_all` per
    process and `max_per_subject` per token subject."""

    def __init__(self, max_all: int, max_per_subject: int) -> None:
        self.max_all, self.max_per_subject = max_all, max_per_subject
        self.subjects: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self, subject: str) -> Iterator[None]:
        with self._lock:
            if sum(self.subjects.values()) >= self.max_all:
                raise TooManyWaiters(f"this API process has {self.max_all} reads waiting")
            if self.subjects.get(subject, 0) >= self.max_per_subject:
                raise TooManyWaiters(
                    f"this token's subject has {self.max_per_subject} reads waiting"
                )
            self.subjects[subject] = self.subjects.get(subject, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self.subjects[subject] - 1
                if left:
                    self.subjects[subject] = left
                else:
                    del self.subjects[subject]


class SlotWatch:
    """The CDC slot's confirmed WAL position, looked at by one thread of its own every 50 ms
    while anyone waits for it, and told to every waiter at once: however many reads of joined
    views wait, Postgres is asked 20 times a second at most."""

    def __init__(self, look: Callable[[], str | None]) -> None:
        self._look = look  # the slot's confirmed_flush_lsn, as text
        self._waiting = 0
        self._confirmed: int | None = None
        self._failure: BaseException | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def wait(self, wal: str, deadline: float) -> bool:
        """Whether the slot confirmed `wal` before `deadline` (time.monotonic)."""
        target = _lsn(wal)
        with self._changed:
            self._waiting += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="slot-watch", daemon=True)
                self._thread.start()
            try:
                while True:
                    if self._failure is not None:
                        failure, self._failure = self._failure, None
                        raise failure
                    if self._confirmed is not None and self._confirmed >= target:
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(left)
            finally:
                self._waiting -= 1

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._waiting:
                    self._thread = None
                    return
            try:
                found = self._look()
                confirmed, failure = (None if found is None else _lsn(found)), None
            except Exception as e:  # the waiters answer 503 from it
                confirmed, failure = None, e
            with self._changed:
                self._confirmed, self._failure = confirmed, failure
                self._changed.notify_all()
            time.sleep(POLL_S)


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)
