"""Health under load and through an outage (guarantee 17): readiness comes from background
checks, so a busy API stays ready and answers at once; with Kafka gone it turns 503 within a
bounded time, and back once Kafka returns; liveness does not depend on Kafka at all; no error
text (hosts, ports) reaches an unauthenticated caller."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from app import close_app, create_app
from cdc.capture import Capture
from commands.processor import CommandProcessor
from config.settings import Settings
from stack.local_kafka import LocalKafka
from stack.procs import wait_until
from tests.support import HttpApi, Processes, drop_cdc_slot, new_deployment, token

ADMIN = {"Authorization": f"Bearer {token('admin')}"}
LOAD_S, LOOKS = 10, 50  # at least: seconds of load, and answers of /health meanwhile


def test_health_stays_ready_and_quick_under_the_highest_command_rate(
    base_settings: Settings, workdir: Path
) -> None:
    deployment = new_deployment(base_settings)
    (workdir / "health-load").mkdir(exist_ok=True)
    procs = Processes(deployment, workdir / "health-load")
    try:
        procs.processor()
        procs.processor()
        procs.cdc()
        _, url = procs.api()
        procs.wait_processing(url, 2)
        wait_until(lambda: requests.get(f"{url}/health", timeout=5).ok, 90, "/health to be 200")

        stop = threading.Event()
        answers: Counter[int] = Counter()
        local = threading.local()

        def post(_: int) -> None:  # closed loop: as fast as the stack answers
            if not hasattr(local, "api"):
                local.api = HttpApi(url, token("commands:write"))
            while not stop.is_set():
                r = local.api.command("register-customer", {"name": "L", "email": "l@example.com"})
                answers[r.status] += 1

        health: list[tuple[int, float]] = []

        def poll() -> None:
            session = requests.Session()
            while not stop.is_set():
                started = time.perf_counter()
                r = session.get(f"{url}/health", timeout=10)
                health.append((r.status_code, time.perf_counter() - started))
                stop.wait(0.1)

        with ThreadPoolExecutor(32) as pool:
            load = [pool.submit(post, i) for i in range(30)]
            poller = pool.submit(poll)
            started = time.monotonic()
            try:
                stop.wait(LOAD_S)
                wait_until(lambda: len(health) >= LOOKS, 60, f"{LOOKS} answers of /health")
            finally:
                stop.set()
            for f in [*load, poller]:
                f.result(timeout=60)
            elapsed = time.monotonic() - started

        rate = answers[201] / elapsed
        taken = sorted(t for _, t in health)
        print(
            f"load: {rate:.0f} commands/s {dict(answers)}; /health {len(health)} answers, "
            f"p50 {statistics.median(taken) * 1e3:.0f} ms, max {taken[-1] * 1e3:.0f} ms"
        )
        assert answers[201] > 0 and set(answers) == {201}, answers  # a real, clean load
        assert {status for status, _ in health} == {200}, Counter(s for s, _ in health)
        # Each answer is a read of the last results: fast even on a saturated machine.
        assert statistics.median(taken) < 0.1, taken
        assert taken[int(len(taken) * 0.9)] < 0.25, taken
    finally:
        procs.stop()
        drop_cdc_slot(deployment)


def test_health_turns_503_when_kafka_stops_and_200_when_it_returns(
    own_broker: LocalKafka, base_settings: Settings
) -> None:
    interval, timeout, failures = 0.5, 1.0, 2
    settings = new_deployment(
        base_settings,
        kafka_bootstrap_servers=own_broker.bootstrap,
        kafka_timeout_s=2.0,
        health_interval_s=interval,
        health_timeout_s=timeout,
        health_failures=failures,
    )
    processor, cdc = CommandProcessor(settings), Capture(settings)
    threads = [
        threading.Thread(target=processor.run, daemon=True),
        threading.Thread(target=cdc.run, daemon=True),
    ]
    for t in threads:
        t.start()
    app = create_app(settings)
    client = app.test_client()
    try:
        wait_until(lambda: client.get("/health").status_code == 200, 90, "/health to be 200")
        assert client.get("/health/live").status_code == 200

        own_broker.proc.kill()  # type: ignore[union-attr]
        own_broker.proc.wait()  # type: ignore[union-attr]
        killed = time.monotonic()
        # A round is every check in turn, each bounded by the timeout; down after `failures`
        # rounds in a row.
        bound = failures * (interval + 5 * timeout) + 10
        wait_until(lambda: client.get("/health").status_code == 503, bound, "/health to be 503")
        print(f"503 after {time.monotonic() - killed:.1f}s (bound {bound:.0f}s)")
        r = client.get("/health")
        assert r.json["status"] == "down" and r.headers["Retry-After"]
        assert r.json["components"]["kafka"]["status"] == "down"
        assert client.get("/health/live").status_code == 200  # alive: only not ready

        # Statuses for everyone; why (with the broker's address) only for admins and the logs.
        text = r.get_data(as_text=True)
        assert "error" not in text and str(own_broker.port) not in text, text
        admin = client.get("/health", headers=ADMIN).json["components"]["kafka"]
        assert admin["status"] == "down" and admin["error"]

        own_broker.start()
        wait_until(lambda: client.get("/health").status_code == 200, 120, "/health to be 200")
        assert client.get("/health").json["components"]["kafka"]["status"] == "up"
    finally:
        close_app(app)
        processor.stop()
        cdc.stop()
        for t in threads:
            t.join(timeout=30)
        drop_cdc_slot(settings)
