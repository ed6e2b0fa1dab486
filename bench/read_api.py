"""through-the-api and first-reads: read-your-writes as a client does it
(see bench/read_side.py)."""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import percentile
from bench.read_stack import Stack, extra, read_your_write, start_warmed, warm_up
from config.settings import Settings
from tests.support import HttpApi, Processes


def first_reads(args: argparse.Namespace) -> dict[str, Any]:
    """A new stack each run, started as `make run` starts it (returned once it would print its
    banner), then --count read-your-writes in a row (`read_your_write`): the README's first
    read against the later ones."""
    runs = []
    for _ in tqdm(range(args.repeats), desc="stacks", unit="run"):
        stack = Stack()
        with stack as settings:
            procs = Processes(settings, stack.work, extra(args))
            try:
                api, _ = start_warmed(stack, procs)
                runs.append([read_your_write(settings, api) for _ in range(args.count)])
            finally:
                procs.stop()
    return {
        "benchmark": "first-reads",
        "first_ms": statistics.median(r[0] for r in runs),
        "later_ms": statistics.median(ms for r in runs for ms in r[1:]),
        "runs_ms": runs,
    }


def through_the_api(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        procs = Processes(settings, stack.work, extra(args))
        try:
            api, _ = start_warmed(stack, procs)
            book, buyers = warm_up(settings, api)
            commands = {
                "customers": lambda i: (
                    "register-customer",
                    {"name": f"r{i}", "email": f"r{i}@example.com"},
                    "SELECT 1 FROM customers WHERE customer_id = %s",
                ),
                "order_summaries": lambda i: (
                    "place-order",
                    {
                        "customer_id": buyers[i % len(buyers)],
                        "lines": [{"book_id": book, "quantity": 1}],
                    },
                    "SELECT 1 FROM order_summaries "
                    "WHERE order_id = %s AND customer_name IS NOT NULL",
                ),
            }
            result: dict[str, Any] = {"benchmark": "read-your-writes", "count": args.count}
            for view, command in commands.items():
                runs = []
                for _ in tqdm(range(args.repeats), desc=view, unit="run"):
                    answered, visible = [], []
                    for i in range(args.count):
                        a, v = read_through_the_api(settings, api, view, *command(i))
                        answered.append(a)
                        visible.append(v)
                    runs.append(
                        {
                            "answered_p50_ms": percentile(answered, 0.5),
                            "answered_p99_ms": percentile(answered, 0.99),
                            "visible_p50_ms": percentile(visible, 0.5),
                            "visible_p99_ms": percentile(visible, 0.99),
                        }
                    )
                result[view] = {
                    **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                    "runs": runs,
                }
            return result
        finally:
            procs.stop()


def read_through_the_api(
    settings: Settings, api: HttpApi, view: str, name: str, data: dict[str, Any], sql: str
) -> tuple[float, float]:
    """One command, then its read-your-write through the API (`consistent_with`, waiting up to
    30 s) and, at the same time, a watch on the row in Postgres every 5 ms: ms from the 201
    until the API answered, and until the row was visible."""
    r = api.command(name, data)
    acked, key, at = time.perf_counter(), r.body["aggregate_id"], r.body["position"]
    seen: list[float] = []

    def watch() -> None:
        with psycopg.connect(settings.database(), autocommit=True) as conn:
            while conn.execute(sql, (key,)).fetchone() is None:
                if time.perf_counter() - acked > 60:
                    return
                time.sleep(0.005)
            seen.append(time.perf_counter())

    watcher = threading.Thread(target=watch)
    watcher.start()
    got = api.get(
        f"/views/{view}/{key}?consistent_with={at}&wait=30",
        headers={"Authorization": f"Bearer {api.bearer}"},
    )
    answered = time.perf_counter()
    watcher.join()
    if got.status_code != 200 or not seen:
        raise RuntimeError(f"{view} {key}: {got.status_code} {got.text[:200]}")
    return (answered - acked) * 1e3, (seen[0] - acked) * 1e3
