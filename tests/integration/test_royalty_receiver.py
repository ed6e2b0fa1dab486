"""The reference receiver (examples/royalty_receiver.py) pays every royalty payout exactly once
although it is SIGKILLed at each of its crash points (after receipt, after logging, after
paying) and the webhook dispatcher (`logfold webhooks`, a real process) is killed with
`kill -9` mid-stream: at-least-once delivery with stable ids, plus the receiver's durable inbox
and its one-transaction payments, make an exactly-once effect.

The `royalty_payouts` rows are written with plain SQL (CDC does not care who writes a table;
driving orders and payments through the command side and the Spark projector would only make
this test slower). Some payouts change afterwards (their account): a change of a paid payout
pays nothing."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from app import close_app, create_app
from cdc.capture import Capture
from config.settings import Settings
from stack.procs import free_port, port_open, stop_process, wait_until
from tests.changes import slot_ready
from tests.support import REPO, Processes, new_deployment, token
from webhooks.signing import new_secret

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {token('admin')}"}
DISPATCHER_ENV = {
    "LOGFOLD_WEBHOOK_ALLOW_PRIVATE": "true",
    "LOGFOLD_WEBHOOK_BACKOFF_BASE_S": "0.05",
    "LOGFOLD_WEBHOOK_BACKOFF_CAP_S": "0.2",
    "LOGFOLD_WEBHOOK_POLL_S": "0.5",
}
WAIT_S = 40
FIRST, LATER = 30, 30  # payouts written before the receiver's crashes, and during the kill


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    return new_deployment(base_settings, webhook_allow_private=True)


class Receiver:
    """examples/royalty_receiver.py as a process of its own, on one port and one database."""

    def __init__(self, workdir: Path, secret: str) -> None:
        self.port, self.secret = free_port(), secret
        self.db, self.logs = workdir / "royalties.sqlite", workdir / "receiver.log"
        self.url = f"http://127.0.0.1:{self.port}/"

    def start(self, crash: str | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROYALTY_RECEIVER_")}
        if crash:
            env["ROYALTY_RECEIVER_CRASH"] = crash
        proc = subprocess.Popen(
            [
                sys.executable,
                "examples/royalty_receiver.py",
                *("--port", str(self.port), "--db", str(self.db), "--secret", self.secret),
            ],
            cwd=REPO,
            env=env,
            stdout=self.logs.open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: port_open(self.port) or proc.poll() is not None, WAIT_S, "receiver")
        return proc

    def payments(self) -> list[tuple[str, str, int]]:
        with sqlite3.connect(self.db) as db:
            rows = db.execute("SELECT order_id, book_id, amount_cents FROM payments").fetchall()
        return [(str(o), str(b), int(a)) for o, b, a in rows]


def write_payouts(settings: Settings, payouts: list[tuple[str, str]], pace: float = 0) -> None:
    """One transaction per payout; after every fifth, the account of an earlier one changes."""
    stop = threading.Event()
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        for i, (order, book) in enumerate(payouts):
            conn.execute(
                "INSERT INTO royalty_payouts (order_id, book_id, author, amount_cents, paid_at) "
                "VALUES (%s, %s, %s, %s, now())",
                (order, book, f"author-{book}", 100 + i),
            )
            if i % 5 == 4:
                earlier = payouts[i - 4]
                conn.execute(
                    "UPDATE royalty_payouts SET payout_account = %s "
                    "WHERE order_id = %s AND book_id = %s",
                    (f"acct-{i}", *earlier),
                )
            if pace:
                stop.wait(pace)  # pacing the load, not waiting for a condition


def expected(settings: Settings, tag: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT order_id, book_id, amount_cents FROM royalty_payouts WHERE order_id LIKE %s",
            (f"{tag}-%",),
        ).fetchall()
    return sorted((str(o), str(b), int(a)) for o, b, a in rows)


@pytest.fixture
def running(deployment: Settings, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(deployment, tmp_path, env=DISPATCHER_ENV)
    yield procs
    procs.stop()


def test_every_payout_is_paid_exactly_once_across_receiver_and_dispatcher_crashes(
    deployment: Settings, capture: Capture, running: Processes, tmp_path: Path
) -> None:
    wait_until(lambda: slot_ready(deployment), WAIT_S, "CDC's first snapshot")
    receiver = Receiver(tmp_path, new_secret())
    app = create_app(deployment)
    try:
        made = app.test_client().post(
            "/webhooks",
            json={"url": receiver.url, "view": "royalty_payouts", "secret": receiver.secret},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.get_json()
    finally:
        close_app(app)
    running.webhooks()
    tag = uuid.uuid4().hex[:8]
    payouts = [(f"{tag}-o{i}", f"b{i % 3}") for i in range(FIRST + LATER)]
    write_payouts(deployment, payouts[:FIRST])

    # The receiver dies at each crash point in turn, at the 4th delivery of each life.
    for point in ("after-receipt", "after-log", "after-pay"):
        proc = receiver.start(f"{point}:4")
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL, point
    paid_before = len(receiver.payments())
    assert 8 <= paid_before < FIRST  # 3 + 4 (the logged one, on restart) + 4, at least

    # A receiver that stays up; the dispatcher is killed -9 while payouts are being written.
    survivor = receiver.start()
    try:
        writer = threading.Thread(
            target=write_payouts, args=(deployment, payouts[FIRST:], 0.02), daemon=True
        )
        writer.start()
        wait_until(lambda: len(receiver.payments()) >= FIRST + 5, WAIT_S, "payments mid-stream")
        victim = running.procs[-1]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert writer.is_alive() or len(receiver.payments()) < FIRST + LATER  # mid-stream
        running.webhooks()
        writer.join(timeout=WAIT_S)
        assert not writer.is_alive()

        want = expected(deployment, tag)
        assert len(want) == FIRST + LATER
        wait_until(lambda: len(receiver.payments()) >= len(want), WAIT_S, "every payout to be paid")
        # and nothing more comes: every change delivered (the cursor at the changelog's end)
        with psycopg.connect(deployment.database()) as conn:
            [(endpoint_id,)] = conn.execute("SELECT id FROM webhook_endpoints").fetchall()

        def settled() -> bool:
            with psycopg.connect(deployment.database()) as conn:
                row = conn.execute(
                    "SELECT attempts, failing_since FROM webhook_endpoints WHERE id = %s",
                    (endpoint_id,),
                ).fetchone()
            return row == (0, None)

        wait_until(settled, WAIT_S, "the endpoint to be healthy")
        paid = receiver.payments()
        assert sorted(paid) == want  # each payout once, with its amount; none lost
        assert len({(o, b) for o, b, _ in paid}) == len(paid)
    finally:
        stop_process(survivor)
