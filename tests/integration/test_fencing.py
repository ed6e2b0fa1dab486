"""Zombie fencing (guarantees 1 and 2): a command processor is frozen with SIGSTOP while it owns
partitions and has commands in flight. It still believes it owns them when it wakes up. The other
processor takes them over after the session timeout; the frozen one is then resumed while the load
goes on. Whatever the zombie still tries to write must be fenced: afterwards every aggregate's
log is dense and every answered command is in it exactly once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from config.settings import Settings
from events.partitioning import partition_for
from stack.procs import wait_until
from tests.integration.load import (
    Background,
    Clients,
    Logical,
    Progress,
    committed_problems,
    logs_tail,
    processors,
    status_counts,
    tail,
    until_answered,
    version_problems,
)
from tests.support import Processes, log_of, new_deployment

pytestmark = [pytest.mark.slow, pytest.mark.integration]

THREADS = 24
BOOKS_PER_PARTITION = 2
MAX_COMMANDS = 6000  # an upper bound; the test stops the load once it has seen what it needs
GIVE_UP_S = 150
BOOK = {"title": "Dune", "author": "Herbert", "price_cents": 1999, "royalty_rate": 0.1}


def books_for(run: str, partitions: int) -> list[str]:
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    n = 0
    while any(len(ids) < BOOKS_PER_PARTITION for ids in found.values()):
        candidate = f"book-{run}-{n}"
        ids = found[partition_for(candidate, partitions)]
        if len(ids) < BOOKS_PER_PARTITION:
            ids.append(candidate)
        n += 1
    return [b for p in sorted(found) for b in found[p]]


class Reprices:
    """Reprices with unique Idempotency-Keys on every book, two in three with the freshest
    expected_version any client knows, each retried (same key) until definitive; runs until
    stopped. Remembers when each partition last had a command committed."""

    def __init__(self, clients: Clients, books: list[str], partitions: int, run: str) -> None:
        self.clients, self.books, self.partitions, self.run = clients, books, partitions, run
        self.versions = dict.fromkeys(books, 1)
        self.last_commit: dict[int, float] = {}
        self.cmds: list[Logical] = []
        self.progress = Progress()
        self.stopping = threading.Event()  # no new commands
        self.abandon = threading.Event()  # no more retries either: the test is over
        self._lock = threading.Lock()
        self.give_up_at = time.monotonic() + GIVE_UP_S
        self.load = Background(self._work, range(MAX_COMMANDS), THREADS)

    def _work(self, i: int) -> None:
        if self.stopping.is_set():
            return
        book = self.books[(i * 7) % len(self.books)]
        cmd = Logical(
            i,
            "reprice-book",
            {"price_cents": 1000 + i},
            key=f"{self.run}-{i}",
            aggregate_id=book,
            expected_version=None if i % 3 == 0 else self.versions[book],
        )
        self.cmds.append(cmd)
        answer = until_answered(self.clients, cmd, i, self.give_up_at, cmd.attempts, self.abandon)
        with self._lock:
            if answer.status in (200, 201):
                self.versions[book] = max(self.versions[book], answer.body["version"])
                self.last_commit[partition_for(book, self.partitions)] = answer.at
            elif answer.status == 409 and answer.body["error"]["code"] == "version_conflict":
                actual = answer.body["error"]["details"][0]["actual_version"]
                self.versions[book] = max(self.versions[book], actual)
        self.progress.tick()

    def every_partition_committed_since(self, t: float) -> Callable[[], bool]:
        return lambda: all(self.last_commit.get(p, 0) > t for p in range(self.partitions))


def test_a_frozen_processor_that_wakes_up_as_a_zombie_writes_nothing(
    base_settings: Settings, tmp_path: Path
) -> None:
    settings = new_deployment(base_settings)
    procs = Processes(settings, tmp_path)
    frozen = None
    load = None
    try:
        zombie = procs.processor()
        procs.processor()
        urls = [procs.api()[1], procs.api()[1]]
        procs.wait_processing(urls[0], 2)
        clients = Clients(urls)
        run = settings.topic_prefix.strip(".")
        books = books_for(run, settings.partitions)
        created = []
        for i, book in enumerate(books):
            add = Logical(-1 - i, "add-book", BOOK, key=f"add-{book}", aggregate_id=book)
            answer = until_answered(clients, add, i, time.monotonic() + 60, add.attempts)
            assert answer.status == 201, add.describe()
            created.append(answer.body)

        load = Reprices(clients, books, settings.partitions, run)
        t0 = time.monotonic()
        load.progress.wait_for(100, timeout=60)
        zombie.send_signal(signal.SIGSTOP)
        frozen = zombie
        stopped_at, answered_at_stop = time.monotonic(), load.progress.count
        wait_until(lambda: processors(urls[0]) == 1, 60, "the group to drop the frozen processor")
        took_over = time.monotonic()
        wait_until(
            load.every_partition_committed_since(took_over), 60, "commits in every partition"
        )
        served = time.monotonic()
        zombie.send_signal(signal.SIGCONT)
        frozen = None
        resumed_at, answered_at_resume = time.monotonic(), load.progress.count
        wait_until(lambda: processors(urls[0]) == 2, 60, "the resumed processor to rejoin")
        rejoined = time.monotonic()
        wait_until(load.every_partition_committed_since(rejoined), 60, "commits in every partition")
        load.progress.wait_for(answered_at_resume + 100, timeout=60)
        load.stopping.set()
        load.load.join(timeout=GIVE_UP_S)
        print(
            f"\nfroze a processor {stopped_at - t0:.1f}s into the load ({answered_at_stop} "
            f"answers); the survivor held every partition after {took_over - stopped_at:.1f}s "
            f"and committed in each after {served - stopped_at:.1f}s; resumed at "
            f"{answered_at_resume} answers, rejoined after {rejoined - resumed_at:.1f}s; "
            f"{len(load.cmds)} commands in all: {dict(status_counts(load.cmds))}"
        )
        zombie_log = tail(tmp_path / "processor-0.log", 400)
        fenced = [ln for ln in zombie_log.splitlines() if "enced" in ln or "Epoch" in ln]
        print(f"zombie log lines about fencing: {len(fenced)}; e.g. {fenced[:3]}")

        cmds = load.cmds
        unanswered = [c.describe() for c in cmds if not c.answered]
        assert not unanswered, "\n".join(unanswered[:20]) + logs_tail(tmp_path)

        def expected(c: Logical) -> bool:
            a = c.final
            assert a is not None
            if a.status in (200, 201):
                return True
            return a.status == 409 and a.body["error"]["code"] == "version_conflict"

        unexpected = [c.describe() for c in cmds if not expected(c)]
        assert not unexpected, "\n".join(unexpected[:20]) + logs_tail(tmp_path)
        committed = [c for c in cmds if c.committed]
        for c in committed:
            body = c.final.body  # type: ignore[union-attr]
            if c.expected_version is not None:
                assert body["version"] == c.expected_version + 1, (c.describe(), body)
        assert any(c.final.status == 409 for c in cmds)  # type: ignore[union-attr]

        log = log_of(settings, "book")
        problems = version_problems(log)
        assert not problems, "versions not dense:\n" + "\n".join(problems)
        bodies = created + [c.final.body for c in committed]  # type: ignore[union-attr]
        problems = committed_problems(log, bodies)
        assert not problems, "answered but not in the log once:\n" + "\n".join(problems[:20])
        assert len(log) == len(books) + len(committed), (
            f"{len(log)} events for {len(books)} creations and {len(committed)} committed "
            "commands: something nobody was told about was written"
        )
    finally:
        if frozen is not None:
            frozen.send_signal(signal.SIGCONT)
        if load is not None:
            load.stopping.set()
            load.abandon.set()
        procs.stop()
