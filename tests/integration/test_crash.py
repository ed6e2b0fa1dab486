"""Guarantees 1, 2 and 4 across crashes: a command processor or an API process is killed with
SIGKILL in the middle of 1,000 registrations (two API processes, two processors, real Kafka).
Clients retry connection errors, 503s and 504s with the same Idempotency-Key, against the other
API process too, until they get a 201 or a 200 replay; some answered keys are sent again on
purpose. Afterwards every answered command is in the log exactly once and no key produced a
second event."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from config.settings import Settings
from config.topics import Topics
from events.partitioning import partition_for
from stack.procs import wait_until
from tests.integration.load import (
    RETRYABLE,
    Attempt,
    Background,
    Clients,
    Logical,
    Progress,
    committed_problems,
    logs_tail,
    processors,
    send,
    status_counts,
    until_answered,
    version_problems,
)
from tests.support import HttpApi, Processes, descendants, log_of, new_deployment

pytestmark = [pytest.mark.slow, pytest.mark.integration]

COUNT = 1000
THREADS = 32
KILL_AFTER = 300  # answers received before the kill
REPLAY_EVERY = 10  # every 10th key is sent again as soon as it is answered
SAMPLE = 100  # answered keys sent again after the load
GIVE_UP_S = 150
BOOK = {"title": "Dune", "author": "Herbert", "price_cents": 1999, "royalty_rate": 0.1}


class Registrations:
    """COUNT register-customer commands without aggregate_id (the server derives it from the
    Idempotency-Key), each sent until answered; the first attempt alternates between APIs."""

    def __init__(self, clients: Clients, run: str) -> None:
        self.clients = clients
        self.cmds = [
            Logical(
                i,
                "register-customer",
                {"name": f"Customer {i}", "email": f"c{i}@{run}.example.com"},
                key=f"{run}-{i}",
            )
            for i in range(COUNT)
        ]
        self.progress = Progress()
        self.abandon = threading.Event()  # set when the test ends early: no more retries
        self.give_up_at = time.monotonic() + GIVE_UP_S
        self.load = Background(self._work, self.cmds, THREADS)

    def _work(self, cmd: Logical) -> None:
        if self.abandon.is_set():
            return
        until_answered(self.clients, cmd, cmd.index, self.give_up_at, cmd.attempts, self.abandon)
        self.progress.tick()
        if cmd.index % REPLAY_EVERY == 0 and cmd.committed:
            replay: list[Attempt] = []
            cmd.replays.append(replay)
            until_answered(self.clients, cmd, cmd.index + 1, self.give_up_at, replay, self.abandon)

    def replay_sample(self, urls: list[str]) -> None:
        """Send SAMPLE answered keys again, after the load, to the given API processes."""
        clients = Clients(urls, self.clients.bearer)
        answered = [c for c in self.cmds if c.committed]
        for n, cmd in enumerate(answered[:: max(len(answered) // SAMPLE, 1)][:SAMPLE]):
            replay: list[Attempt] = []
            cmd.replays.append(replay)
            until_answered(clients, cmd, n, time.monotonic() + 60, replay)


def check(settings: Settings, run: Registrations, logdir: Path) -> None:
    cmds = run.cmds
    counts = status_counts(cmds)
    retried = [c for c in cmds if len(c.attempts) > 1]
    print(
        f"answers: {dict(counts)}; {len(retried)} commands needed retries "
        f"(most attempts: {max(len(c.attempts) for c in cmds)})"
    )
    problems = []
    for c in cmds:
        if not c.committed:
            problems.append(f"no 201/200: {c.describe()}")
            continue
        first = c.final.body  # type: ignore[union-attr]
        definitive = [a for a in c.attempts if a.status not in RETRYABLE]
        if len(definitive) != 1:
            problems.append(f"several definitive answers: {c.describe()}")
        for replay in c.replays:
            last = replay[-1]
            if last.status != 200 or not last.replay:
                problems.append(f"re-send was not a replay ({last.status}): {c.describe()}")
            elif last.body != first:
                problems.append(f"replay differs: {c.describe()}: {last.body} != {first}")
    if problems:
        pytest.fail(
            f"{len(problems)} problems ({dict(counts)}):\n"
            + "\n".join(problems[:20])
            + "\n"
            + logs_tail(logdir)
        )

    bodies = {c.key: c.final.body for c in cmds}  # type: ignore[union-attr]
    ids = {b["aggregate_id"] for b in bodies.values()}
    assert len(ids) == COUNT, f"{COUNT} keys answered with {len(ids)} aggregate ids"

    log = log_of(settings, "customer")
    per_aggregate: dict[str, list[str]] = defaultdict(list)
    for e in log:
        per_aggregate[e.aggregate_id].append(e.type)
    doubled = {a: ts for a, ts in per_aggregate.items() if ts != ["CustomerRegistered"]}
    assert not doubled, f"a key produced more than one event: {list(doubled.items())[:10]}"
    assert not version_problems(log)
    problems = committed_problems(log, bodies.values())
    assert not problems, "answered but not in the log once:\n" + "\n".join(problems[:20])
    assert set(per_aggregate) == ids, (
        f"{len(set(per_aggregate) - ids)} events nobody got a 201 for, "
        f"{len(ids - set(per_aggregate))} 201s missing from the log"
    )
    assert len(log) == COUNT
    partitions = {partition_for(a, settings.partitions) for a in ids}
    assert partitions == set(range(settings.partitions)), partitions


def start(base_settings: Settings, tmp_path: Path) -> tuple[Settings, Processes, list[str]]:
    settings = new_deployment(base_settings)
    procs = Processes(settings, tmp_path)
    procs.processor()
    procs.processor()
    urls = [procs.api()[1], procs.api()[1]]
    procs.wait_processing(urls[0], 2)
    return settings, procs, urls


def sigkill(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGKILL the process and all its descendants at once: none of them gets to clean up or,
    for gunicorn, to respawn a worker. Returns the pids killed."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.wait(10)
    return pids


def test_sigkill_of_a_command_processor_mid_load_loses_nothing_and_doubles_nothing(
    base_settings: Settings, tmp_path: Path
) -> None:
    procs, run = None, None
    try:
        settings, procs, urls = start(base_settings, tmp_path)
        victim = procs.procs[0]
        run = Registrations(Clients(urls), settings.topic_prefix.strip("."))  # starts the load
        run.progress.wait_for(KILL_AFTER, timeout=90)
        sigkill(victim)
        killed = time.monotonic()
        answered_at_kill = run.progress.count
        wait_until(lambda: processors(urls[0]) == 1, 60, "the group to drop the killed processor")
        print(
            f"\nkilled a processor after {answered_at_kill} answers; group had 1 member after "
            f"{time.monotonic() - killed:.1f}s"
        )
        elapsed = run.load.join(timeout=GIVE_UP_S + 30)
        print(f"{COUNT} registrations answered in {elapsed:.1f}s")
        run.replay_sample(urls)
        retried_after_kill = [
            c for c in run.cmds if any(a.status in (503, 504) for a in c.attempts)
        ]
        check(settings, run, tmp_path)
        assert retried_after_kill, "the kill did not hit a single command: nothing was tested"
    finally:
        if run is not None:
            run.abandon.set()
        if procs is not None:
            procs.stop()


def test_sigkill_of_an_api_process_mid_load_loses_nothing_and_doubles_nothing(
    base_settings: Settings, tmp_path: Path
) -> None:
    procs, run = None, None
    try:
        settings, procs, urls = start(base_settings, tmp_path)
        victim = procs.procs[2]  # the first API process, serving urls[0]
        run = Registrations(Clients(urls), settings.topic_prefix.strip("."))  # starts the load
        run.progress.wait_for(KILL_AFTER, timeout=90)
        pids = sigkill(victim)
        print(f"\nkilled an API process (pids {pids}) after {run.progress.count} answers")
        elapsed = run.load.join(timeout=GIVE_UP_S + 30)
        print(f"{COUNT} registrations answered in {elapsed:.1f}s")
        run.replay_sample(urls[1:])
        failed_over = [c for c in run.cmds if any(a.status is None for a in c.attempts)]
        check(settings, run, tmp_path)
        assert failed_over, "the kill did not hit a single request: nothing was tested"
    finally:
        if run is not None:
            run.abandon.set()
        if procs is not None:
            procs.stop()


def test_a_retry_queued_behind_its_original_gets_the_original_answer(
    base_settings: Settings, tmp_path: Path
) -> None:
    """A client whose connection dropped retries at once, on the other API process, while its
    first attempt still waits in the commands topic: both reach the processor in one batch.
    The retry must get the first answer again (200 replay), never a second event or an error."""
    settings = new_deployment(base_settings)
    procs = Processes(settings, tmp_path)
    processor = procs.processor()
    stopped = False
    try:
        urls = [procs.api()[1], procs.api()[1]]
        procs.wait_processing(urls[0], 1)
        clients = Clients(urls)
        book = "book-queued-retry"
        add = Logical(0, "add-book", BOOK, key="add", aggregate_id=book)
        assert until_answered(clients, add, 0, time.monotonic() + 60, add.attempts).status == 201
        commands = Topics(settings.topic_prefix).commands
        tps = [TopicPartition(commands, p) for p in range(settings.partitions)]
        offsets = KafkaConsumer(bootstrap_servers=settings.kafka())

        def queued_at_least(n: int) -> Callable[[], bool]:
            return lambda: sum(offsets.end_offsets(tps).values()) >= n

        decoy = Logical(3, "register-customer", {"name": "D", "email": "d@example.com"}, key="d")
        pairs = [
            Logical(1, "register-customer", {"name": "Q", "email": "q@example.com"}, key="q"),
            Logical(2, "reprice-book", {"price_cents": 2500}, key="r", aggregate_id=book),
        ]
        sends = [(cmd, url) for cmd in pairs for url in urls]
        try:
            queued = sum(offsets.end_offsets(tps).values())
            processor.send_signal(signal.SIGSTOP)  # for well under the 10 s session timeout
            stopped = True
            with ThreadPoolExecutor(len(sends) + 1) as pool:
                # The decoy completes the fetch the frozen processor may have pending, so that
                # both attempts of each command come back to it in one later fetch: one batch.
                decoyed = pool.submit(send, HttpApi(urls[0], clients.bearer), decoy)
                wait_until(queued_at_least(queued + 1), 5, "the decoy in the commands topic")
                futures = [pool.submit(send, HttpApi(url, clients.bearer), c) for c, url in sends]
                wait_until(queued_at_least(queued + 1 + len(sends)), 5, "all attempts queued")
                processor.send_signal(signal.SIGCONT)
                stopped = False
                answers = [f.result() for f in futures]
                assert decoyed.result().status == 201, decoyed.result()
        finally:
            offsets.close()
        answered = list(zip(sends, answers, strict=True))
        summary = [(cmd.name, a.status, a.replay, a.body) for (cmd, _), a in answered]
        for cmd in pairs:
            got = sorted((a.status, a.replay) for (c, _), a in answered if c is cmd)
            assert got == [(200, True), (201, False)], "\n".join(map(str, summary))
        books = [e for e in log_of(settings, "book") if e.aggregate_id == book]
        assert [e.version for e in books] == [1, 2], f"the retry wrote again: {books}"
    finally:
        if stopped:
            processor.send_signal(signal.SIGCONT)
        procs.stop()
