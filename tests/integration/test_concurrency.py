"""Guarantee 2 under real concurrency: two API processes and two command processors (real
subprocesses, real Kafka), 200 racing commands on four books. Per aggregate the log holds versions
1..n with no gap or duplicate, every 201 is in the log exactly once where it said, and every 409
left nothing behind."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from config.settings import Settings
from events.partitioning import partition_for
from tests.integration.load import (
    Background,
    Clients,
    Logical,
    committed_problems,
    logs_tail,
    send,
    status_counts,
    until_answered,
    version_problems,
)
from tests.support import Processes, log_of, new_deployment

pytestmark = [pytest.mark.slow, pytest.mark.integration]

COMMANDS = 200
THREADS = 32
BOOK = {"title": "Dune", "author": "Herbert", "price_cents": 1999, "royalty_rate": 0.1}


def one_book_per_partition(run: str, partitions: int) -> list[str]:
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < partitions:
        candidate = f"book-{run}-{n}"
        ids.setdefault(partition_for(candidate, partitions), candidate)
        n += 1
    return [ids[p] for p in sorted(ids)]


def test_racing_reprices_on_two_apis_and_two_processors_keep_every_log_dense(
    base_settings: Settings, tmp_path: Path
) -> None:
    settings = new_deployment(base_settings)
    procs = Processes(settings, tmp_path)
    try:
        procs.processor()
        procs.processor()
        _, url1 = procs.api()
        _, url2 = procs.api()
        procs.wait_processing(url1, 2)
        clients = Clients([url1, url2])
        run = settings.topic_prefix.strip(".")
        books = one_book_per_partition(run, settings.partitions)

        created = []
        for i, book in enumerate(books):
            add = Logical(-1 - i, "add-book", BOOK, key=f"add-{book}", aggregate_id=book)
            answer = until_answered(clients, add, i, time.monotonic() + 60, add.attempts)
            assert answer.status == 201, add.describe()
            created.append(answer.body)

        # The last version any client has learned of each book (from a 201 or a 409's details):
        # every worker races with the freshest knowledge there is, so most of them collide.
        versions = dict.fromkeys(books, 1)
        lock = threading.Lock()
        cmds: list[Logical] = []

        def learn(book: str, version: int) -> None:
            with lock:
                versions[book] = max(versions[book], version)

        def work(i: int) -> None:
            book = books[i % len(books)]
            cmd = Logical(
                i,
                "reprice-book",
                {"price_cents": 1000 + i},
                aggregate_id=book,
                expected_version=None if i % 5 == 0 else versions[book],
            )
            cmds.append(cmd)
            answer = send(clients.api(clients.urls[(i // len(books)) % 2]), cmd)
            cmd.attempts.append(answer)
            if answer.status == 201:
                learn(book, answer.body["version"])
            elif answer.status == 409 and answer.body["error"]["code"] == "version_conflict":
                learn(book, answer.body["error"]["details"][0]["actual_version"])

        load = Background(work, range(COMMANDS), THREADS)
        elapsed = load.join(timeout=150)
        counts = status_counts(cmds)
        print(f"\n{COMMANDS} commands in {elapsed:.1f}s on {THREADS} threads: {dict(counts)}")

        def expected(c: Logical) -> bool:
            a = c.final
            if a is None or a.status not in (201, 409):
                return False
            return a.status == 201 or a.body["error"]["code"] == "version_conflict"

        unexpected = [c.describe() for c in cmds if not expected(c)]
        assert not unexpected, f"{counts}\n" + "\n".join(unexpected[:20]) + logs_tail(tmp_path)

        won = [c for c in cmds if c.final is not None and c.final.status == 201]
        lost = [c for c in cmds if c.final is not None and c.final.status == 409]
        raced = [c for c in won if c.expected_version is not None]
        assert lost and raced, f"the load did not race: {counts}"
        # Of the commands that expected one version of one book, at most one won.
        winners = Counter((c.aggregate_id, c.expected_version) for c in raced)
        assert max(winners.values()) == 1, winners.most_common(3)
        for c in won:
            body = c.final.body  # type: ignore[union-attr]
            assert body["aggregate_id"] == c.aggregate_id, c.describe()
            assert [e["type"] for e in body["events"]] == ["BookRepriced"], body
            assert body["events"][0]["version"] == body["version"], body
            if c.expected_version is not None:
                assert body["version"] == c.expected_version + 1, (c.describe(), body)

        log = log_of(settings, "book")
        problems = version_problems(log)
        assert not problems, "versions not dense:\n" + "\n".join(problems)
        bodies = created + [c.final.body for c in won]  # type: ignore[union-attr]
        problems = committed_problems(log, bodies)
        assert not problems, "201s not in the log exactly once:\n" + "\n".join(problems[:20])
        assert len(log) == len(books) + len(won), (
            f"{len(log)} events in the log, {len(books)} creations + {len(won)} 201s: "
            "a 409 left something behind"
        )

        final = Counter(e.aggregate_id for e in log)
        wins = Counter(c.aggregate_id for c in won)
        assert final == {b: 1 + wins[b] for b in books}
        conflicts: dict[str, list[int]] = defaultdict(list)
        for c in lost:
            detail = c.final.body["error"]["details"][0]  # type: ignore[union-attr]
            assert detail["expected_version"] == c.expected_version, c.describe()
            assert detail["actual_version"] != c.expected_version, detail
            assert 1 <= detail["actual_version"] <= final[c.aggregate_id], detail  # type: ignore[index]
            conflicts[c.aggregate_id].append(detail["actual_version"])  # type: ignore[index]
        print(
            "per book (partition, final version, 201s, 409s): "
            + ", ".join(
                f"{b}=(p{partition_for(b, settings.partitions)}, v{final[b]}, {wins[b]}, "
                f"{len(conflicts[b])})"
                for b in books
            )
        )
    finally:
        procs.stop()
