"""The API's floor: CPU per request of gunicorn's threaded worker with nothing behind it, and of
Logfold's Flask app with a command bus that answers at once (no Kafka), under the load of
`bench/commands.py load` (open loop, keep-alive connections).

    .venv/bin/python bench/http_floor.py --rate 500 --duration 8 --repeats 3

What is left of an API process's CPU per command in `bench/commands.py load` once these are
taken away is its Kafka clients: producing the command and reading the replies."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import loadgen  # noqa: E402
from bench.procstat import cpu_seconds, tree  # noqa: E402
from stack.procs import free_port, wait_until  # noqa: E402
from tests.support import SECRET, token  # noqa: E402

StartResponse = Callable[..., Any]


def bare(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    """A WSGI app that reads the body and answers 201 `{}`: the server alone."""
    environ["wsgi.input"].read()
    start_response("201 Created", [("Content-Type", "application/json"), ("Content-Length", "2")])
    return [b"{}"]


def logfold_app() -> Any:
    """Logfold's app (auth, validation, metrics, error mapping) with a bus that answers at once
    and no Kafka, Postgres or websocket hub behind it."""
    from app import create_app
    from commands.messages import CommandMessage, Reply
    from config.settings import Settings

    class AnsweringBus:
        instance_id = "api-floor"

        def new_message(self, **fields: Any) -> CommandMessage:
            return CommandMessage(reply_to=self.instance_id, deadline=time.time() + 10, **fields)

        def submit(self, msg: CommandMessage) -> Reply:
            body = {"aggregate_id": msg.aggregate_id, "version": 2, "events": [], "position": ""}
            return Reply(msg.command_id, 201, body)

        def close(self) -> None:
            pass

    class Nothing:
        def __getattr__(self, name: str) -> Callable[..., None]:
            return lambda *args, **kwargs: None

    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",
        database_url="postgresql://floor@127.0.0.1:1/floor",
        jwt_secret=SECRET,
    )
    return create_app(
        settings, bus=AnsweringBus(), read_model=Nothing(), health=Nothing(), hub=Nothing()
    )


APPS = {
    "gunicorn alone": "bench.http_floor:bare",
    "Logfold's app": "bench.http_floor:logfold_app()",
}


def measure(target: str, rate: float, duration: float, repeats: int, threads: int) -> list[float]:
    """CPU ms per request of one gunicorn process (threaded worker, as `logfold api` runs)."""
    port = free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "gunicorn", "--worker-class", "gthread", "--workers", "1"),
            *("--threads", str(threads), "--bind", f"127.0.0.1:{port}", target),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    body = loadgen.renames(["floor-1", "floor-2"])
    try:
        wait_until(lambda: requests.get(f"{url}/", timeout=1) is not None, 60, f"gunicorn at {url}")
        loadgen.offered_load([url], token(), body, rate, 3)  # warm up
        found = []
        for _ in range(repeats):
            pids = tree(server.pid)
            user, system = cpu_seconds(pids)
            result = loadgen.offered_load([url], token(), body, rate, duration)
            user2, system2 = cpu_seconds(pids)
            if set(result.statuses) != {201}:
                raise SystemExit(f"{target}: unexpected answers {result.statuses}")
            found.append((user2 + system2 - user - system) * 1000 / sum(result.statuses.values()))
        return found
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500, help="requests/s offered")
    parser.add_argument("--duration", type=float, default=8, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs (median reported)")
    parser.add_argument("--threads", type=int, default=512, help="gunicorn threads per process")
    args = parser.parse_args()
    out = {}
    for name, target in APPS.items():
        runs = measure(target, args.rate, args.duration, args.repeats, args.threads)
        out[name] = {"cpu_ms_per_request": round(statistics.median(runs), 3), "runs": runs}
    print(json.dumps({"rate_per_s": args.rate, **out}, indent=2))


if __name__ == "__main__":
    main()
