"""Websocket push benchmarks on the full local stack (real Kafka, Postgres, and `logfold`
processes started with the project's CLI).

    .venv/bin/python bench/live.py freshness --rates 5 20 50 --duration 60 --repeats 3
    .venv/bin/python bench/live.py fanout --clients 1000 --rates 2 5 10 20 --duration 30 --repeats 3

freshness: first the ceiling, as in `read_side.py freshness` (a trivial Kafka -> foreachBatch ->
Postgres query, same rates); then processor, projector, cdc and api processes; one websocket
client subscribed to `customers` filtered on a name that the run's `register-customer` commands
all use. Commands are posted open-loop at each rate; for each `201` we time the arrival of the
websocket `change` whose row has the command's aggregate id and version. A plain Kafka consumer
of `cdc.customers` in the bench splits that time: the change's commit in Postgres (the
`committed_at` header, i.e. when the projector made the row visible), when CDC produced the
record (its CreateTime) and when an ordinary consumer could read it.

fanout: cdc and api processes only (no events: the changes are plain SQL `UPDATE customers`,
which isolates the push path). N websocket subscribers of `customers` in one or a few client
processes (bench/wsfleet.py), then updates at a fixed rate, one row per transaction; every
subscriber should receive every change. Latency is from the change's commit time (its
`committed_at`, from the changelog) to receipt, both on this machine's clock; throughput is
messages received by all subscribers per second. CPU of each process tree and the API's RSS are
read from /proc.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import requests
import websocket
from kafka import KafkaConsumer, TopicPartition
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import percentile
from bench.procstat import CpuMeter, rss_mib, threads, tree
from bench.read_freshness import trivial_query
from bench.read_stack import Stack
from bench.wsfleet import Fleet
from config.settings import Settings, kafka_fetch_bounds
from config.topics import Topics
from stack.procs import wait_until
from tests.support import HttpApi, Processes, token


def summary(values: list[float]) -> dict[str, float]:
    """p50/p99/max in ms of durations in seconds."""
    return {
        "p50_ms": percentile(values, 0.5) * 1e3,
        "p99_ms": percentile(values, 0.99) * 1e3,
        "max_ms": max(values) * 1e3 if values else float("nan"),
    }


def ws_url(api_url: str) -> str:
    return api_url.replace("http://", "ws://", 1) + "/ws?token=" + token("views:read")


@dataclass
class Record:
    """A changelog record as the bench's own consumer saw it (times are epoch seconds)."""

    position: str
    row: dict[str, Any] | None
    committed_at: float  # the transaction's commit in Postgres
    produced_at: float  # CDC handed it to its Kafka producer (the record's CreateTime)
    read_at: float  # this plain consumer received it


class Tap:
    """A plain consumer of one `cdc.<table>` topic from its current end, noting each record."""

    def __init__(self, settings: Settings, table: str) -> None:
        self.consumer = KafkaConsumer(
            bootstrap_servers=settings.kafka(),
            enable_auto_commit=False,
            group_id=None,
            fetch_max_wait_ms=200,  # as the websocket hub's consumer
            **kafka_fetch_bounds(),
        )
        tp = TopicPartition(Topics(settings.topic_prefix).cdc(table), 0)
        self.consumer.assign([tp])
        self.consumer.seek_to_end(tp)
        self.consumer.position(tp)
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdc-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self.consumer.poll(timeout_ms=100)
            now = time.time()
            for records in batch.values():
                for r in records:
                    headers = {k: v.decode() for k, v in r.headers or ()}
                    committed = datetime.fromisoformat(headers["committed_at"]).timestamp()
                    row = json.loads(r.value)["row"] if r.value is not None else None
                    self.records.append(
                        Record(headers["position"], row, committed, r.timestamp / 1e3, now)
                    )

    def stop(self) -> list[Record]:
        self._stop.set()
        self._thread.join(timeout=30)
        self.consumer.close()
        return self.records


class Watcher:
    """One websocket client that notes when each change of a customer's version arrives."""

    def __init__(self, api_url: str) -> None:
        self.ws = websocket.create_connection(ws_url(api_url), timeout=30)
        self.lock = threading.Lock()
        self.arrived: dict[tuple[str, int], float] = {}  # (customer_id, version) -> first receipt
        self.snapshots: set[str] = set()
        self.errors: list[dict[str, Any]] = []
        threading.Thread(target=self._read, name="ws-watcher", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                _, data = self.ws.recv_data()
                now = time.time()
                m = json.loads(data)
            except (websocket.WebSocketException, OSError, ValueError):
                return  # closed
            with self.lock:
                if m["type"] == "change" and m["row"] is not None:
                    self.arrived.setdefault((m["row"]["customer_id"], m["row"]["version"]), now)
                elif m["type"] == "snapshot":
                    self.snapshots.add(m["id"])
                elif m["type"] in ("error", "lagging", "resync"):
                    self.errors.append(m)

    def subscribe(self, sub_id: str, view: str, filter: dict[str, Any], timeout: float) -> None:
        """Subscribe and wait for the snapshot, again after an error (the hub not ready)."""
        message = json.dumps({"op": "subscribe", "id": sub_id, "view": view, "filter": filter})
        self.ws.send(message)

        def subscribed() -> bool:
            with self.lock:
                if sub_id in self.snapshots:
                    return True
                failed = [e for e in self.errors if e.get("id") == sub_id]
                self.errors = [e for e in self.errors if e.get("id") != sub_id]
            if failed:
                self.ws.send(message)
            return False

        wait_until(subscribed, timeout, f"a snapshot of {view}", interval=0.5)

    def unsubscribe(self, sub_id: str) -> None:
        self.ws.send(json.dumps({"op": "unsubscribe", "id": sub_id}))

    def close(self) -> None:
        self.ws.close()


def open_loop(rate: float, duration: float, one: Callable[[int, float], None]) -> None:
    """Call `one(i, scheduled_time)` at `rate` per second for `duration` s, on time even when
    calls are slow (no coordinated omission)."""
    start = time.time() + 0.2

    def scheduled(i: int) -> None:
        at = start + i / rate
        delay = at - time.time()
        if delay > 0:
            time.sleep(delay)
        one(i, at)

    with ThreadPoolExecutor(max_workers=min(256, int(rate) + 16)) as pool:
        list(pool.map(scheduled, range(int(rate * duration))))


# -- freshness ------------------------------------------------------------------------------


def freshness(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        ceiling = [
            {"offered_per_s": rate, **trivial_query(settings, rate, args.duration, args.repeats)}
            for rate in args.rates
        ]
        procs = Processes(settings, stack.work)
        try:
            roots = {
                "processor": procs.processor().pid,
                "projector": procs.projector().pid,
                "cdc": procs.cdc().pid,
            }
            api_proc, url = procs.api()
            roots |= stack.infrastructure() | {"api": api_proc.pid}
            procs.wait_processing(url, 1)
            api = HttpApi(url, token())
            watcher = Watcher(url)
            meter = CpuMeter(roots | {"bench": os.getpid()}, alone=("bench",))
            # Warm up: the projector's first batch and the hub's start take a while.
            _freshness_run(settings, api, watcher, meter, 2, 10, timeout=300)
            levels = []
            for rate in tqdm(args.rates, desc="rates", unit="level"):
                runs = [
                    _freshness_run(settings, api, watcher, meter, rate, args.duration)
                    for _ in range(args.repeats)
                ]
                levels.append({"offered_per_s": rate, **_medians(runs), "runs": runs})
            watcher.close()
            return {
                "benchmark": "live-freshness",
                "view": "customers (filtered on name)",
                "duration_s": args.duration,
                "levels": levels,
                "ceiling": ceiling,
            }
        finally:
            procs.stop()


def _freshness_run(
    settings: Settings,
    api: HttpApi,
    watcher: Watcher,
    meter: CpuMeter,
    rate: float,
    duration: float,
    timeout: float = 120,
) -> dict[str, Any]:
    tag = f"fresh-{uuid.uuid4().hex[:8]}"
    watcher.subscribe(tag, "customers", {"name": tag}, timeout)
    tap = Tap(settings, "customers")
    sent: dict[str, tuple[float, float]] = {}  # customer id -> (scheduled, 201 received)
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def one(i: int, at: float) -> None:
        data = {"name": tag, "email": f"{tag}-{i}@example.com"}
        try:
            r = api.command("register-customer", data, key=f"{tag}-{i}")
        except requests.ConnectionError:  # an idle keep-alive connection the server closed
            r = api.command("register-customer", data, key=f"{tag}-{i}")
        now = time.time()
        with lock:
            statuses[r.status] = statuses.get(r.status, 0) + 1
            if r.status == 201:
                sent[r.body["aggregate_id"]] = (at, now)

    meter.start()
    open_loop(rate, duration, one)

    def arrived() -> bool:
        with watcher.lock:
            return all((cid, 1) in watcher.arrived for cid in sent)

    with contextlib.suppress(TimeoutError):
        wait_until(arrived, timeout, "every change on the websocket", interval=0.2)
    cpu = meter.stop()
    time.sleep(0.5)
    cdc = {r.row["customer_id"]: r for r in tap.stop() if r.row and r.row["name"] == tag}
    watcher.unsubscribe(tag)

    stages: dict[str, list[float]] = {
        k: []
        for k in (
            "command",
            "total",
            "to_commit",
            "commit_to_produced",
            "produced_to_consumer",
            "produced_to_ws",
        )
    }
    with watcher.lock:
        arrivals = {cid: watcher.arrived.get((cid, 1)) for cid in sent}
    for cid, (at, answered) in sent.items():
        stages["command"].append(answered - at)
        ws, rec = arrivals[cid], cdc.get(cid)
        if ws is not None:
            stages["total"].append(ws - answered)
        if rec is not None:
            stages["to_commit"].append(rec.committed_at - answered)
            stages["commit_to_produced"].append(rec.produced_at - rec.committed_at)
            stages["produced_to_consumer"].append(rec.read_at - rec.produced_at)
            if ws is not None:
                stages["produced_to_ws"].append(ws - rec.produced_at)
    return {
        "offered_per_s": rate,
        "statuses": statuses,
        "created": len(sent),
        "pushed": len(stages["total"]),
        "in_changelog": len(cdc),
        **{k: summary(v) for k, v in stages.items()},
        "cpu": cpu,
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over runs of each stage's p50 and p99."""
    out: dict[str, Any] = {}
    for stage, value in runs[0].items():
        if isinstance(value, dict) and "p50_ms" in value:
            out[stage] = {
                q: statistics.median(r[stage][q] for r in runs) for q in ("p50_ms", "p99_ms")
            }
    return out


# -- fanout ---------------------------------------------------------------------------------


def fanout(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        api_threads = args.api_threads or args.clients + 200
        procs = Processes(settings, stack.work, {"LOGFOLD_API_THREADS": str(api_threads)})
        fleets: list[Fleet] = []
        try:
            keys = _seed(settings, args.rows)
            cdc = procs.cdc()
            api_proc, url = procs.api()
            probe = Watcher(url)  # also waits until the hub has read the changelogs
            probe.subscribe("probe", "customers", {"name": "nobody"}, timeout=180)
            probe.close()
            no_clients_rss = rss_mib(tree(api_proc.pid))

            subscribe = {"op": "subscribe", "id": "s", "view": "customers", "filter": {}}
            sizes = [
                args.clients // args.client_procs + (i < args.clients % args.client_procs)
                for i in range(args.client_procs)
            ]
            fleets = [Fleet(ws_url(url), n, subscribe) for n in sizes]
            t = time.monotonic()
            for fleet in fleets:
                fleet.control.send("connect")
            connected = sum(fleet.control.recv() for fleet in fleets)
            wait_until(
                lambda: sum(f.ask("status")["snapshots"] for f in fleets) == args.clients,
                300,
                "every subscriber's snapshot",
                interval=1,
            )
            connect_s = time.monotonic() - t

            roots = stack.infrastructure() | {"api": api_proc.pid, "cdc": cdc.pid}
            roots |= {f"clients{i}": f.pid for i, f in enumerate(fleets)}
            meter = CpuMeter(roots | {"bench": os.getpid()}, alone=("bench",))
            api_tree = tree(api_proc.pid)
            meter.start()
            time.sleep(args.idle)
            idle = {
                "api_rss_mib_before_clients": no_clients_rss,
                "api_rss_mib": rss_mib(api_tree),
                "api_threads": threads(api_tree),
                "cpu": _clients_total(meter.stop()),
            }

            levels = []
            for rate in tqdm(args.rates, desc="rates", unit="level"):
                runs = [
                    _fanout_run(settings, fleets, meter, api_proc.pid, keys, rate, args.duration)
                    for _ in range(args.repeats)
                ]
                levels.append(
                    {
                        "changes_per_s": rate,
                        **{
                            k: statistics.median(r[k] for r in runs)
                            for k in (
                                "delivered_per_s",
                                "delivered_ratio",
                                "p50_ms",
                                "p99_ms",
                                "api_rss_peak_mib",
                            )
                        },
                        "runs": runs,
                    }
                )
            return {
                "benchmark": "live-fanout",
                "view": "customers (unfiltered)",
                "subscribers": args.clients,
                "connected": connected,
                "client_processes": args.client_procs,
                "api_threads_setting": api_threads,
                "rows": args.rows,
                "duration_s": args.duration,
                "connect_and_snapshot_s": connect_s,
                "idle": idle,
                "levels": levels,
            }
        finally:
            for fleet in fleets:
                fleet.close()
            procs.stop()


def _seed(settings: Settings, rows: int) -> list[str]:
    keys = [f"fan-{i:05d}" for i in range(rows)]
    with psycopg.connect(settings.database()) as conn:
        conn.cursor().executemany(
            "INSERT INTO customers (customer_id, name, email, registered_at, version) "
            "VALUES (%s, 'fan', %s, now(), 0)",
            [(k, f"{k}@example.com") for k in keys],
        )
    return keys


def _fanout_run(
    settings: Settings,
    fleets: list[Fleet],
    meter: CpuMeter,
    api_pid: int,
    keys: list[str],
    rate: float,
    duration: float,
) -> dict[str, Any]:
    tap = Tap(settings, "customers")
    for fleet in fleets:
        fleet.ask("reset")
    statuses = [f.ask("status") for f in fleets]
    open_before = sum(s["snapshots"] - s["closed"] for s in statuses)
    peak = [0.0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            peak[0] = max(peak[0], rss_mib(tree(api_pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    writes = [0]
    conn = psycopg.connect(settings.database(), autocommit=True)
    write_lock = threading.Lock()

    def update(i: int, _: float) -> None:
        with write_lock:  # one writer connection: commits in order, one row each
            conn.execute(
                "UPDATE customers SET version = version + 1 WHERE customer_id = %s",
                (keys[i % len(keys)],),
            )
            writes[0] += 1

    meter.start()
    open_loop(rate, duration, update)
    expected = writes[0] * open_before
    last, still = -1, time.monotonic()
    while time.monotonic() - still < 10:  # until all arrived, or nothing more for 10 s
        got = sum(f.ask("status")["changes"] for f in fleets)
        if got >= expected:
            break
        if got != last:
            last, still = got, time.monotonic()
        time.sleep(0.2)
    cpu = _clients_total(meter.stop())
    sampling.set()
    sampler.join()
    conn.close()
    time.sleep(0.5)
    records = tap.stop()
    committed = {r.position: r.committed_at for r in records}

    latencies: list[float] = []
    kinds: dict[str, int] = {}
    closes: dict[str, int] = {}
    first, last_receipt, received, unknown = float("inf"), 0.0, 0, 0
    for fleet in fleets:
        got_ = fleet.ask("collect")
        for k, n in got_["kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
        for k, n in got_["closes"].items():
            closes[k] = closes.get(k, 0) + n
        for position, times in got_["times"].items():
            at = committed.get(position.decode())
            if at is None:
                unknown += len(times)
                continue
            first = min(first, at)
            last_receipt = max(last_receipt, max(times))
            received += len(times)
            latencies.extend(t - at for t in times)
    span = last_receipt - first
    return {
        "changes_per_s": rate,
        "writes": writes[0],
        "subscribers": open_before,
        "expected": expected,
        "received": received,
        "unmatched": unknown,
        "delivered_ratio": received / expected if expected else float("nan"),
        "delivered_per_s": received / span if span > 0 else float("nan"),
        "first_commit_to_last_receipt_s": span,
        **summary(latencies),
        # for comparison: commit -> a plain Kafka consumer of the changelog (as the hub's)
        "commit_to_consumer": summary([r.read_at - r.committed_at for r in records]),
        "other_messages": kinds,
        "closes": closes,
        "api_rss_peak_mib": peak[0],
        "cpu": cpu,
    }


def _clients_total(cpu: dict[str, float]) -> dict[str, float]:
    """Fold the client processes' CPU (`clients<i>_…`) into `clients_pct`, `clients_sys_pct`
    and `clients_jit_pct`."""
    out = {k: v for k, v in cpu.items() if not k.startswith("clients")}
    for suffix in ("_pct", "_sys_pct", "_jit_pct"):
        out["clients" + suffix] = sum(
            v
            for k, v in cpu.items()
            if k.startswith("clients") and k[7:].lstrip("0123456789") == suffix
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    f = sub.add_parser("freshness", help="command 201 -> change on a websocket, at several rates")
    f.add_argument("--rates", type=float, nargs="+", default=[5, 20, 50])
    f.add_argument("--duration", type=float, default=60)
    f.add_argument("--repeats", type=int, default=3)
    o = sub.add_parser("fanout", help="many subscribers of one view: messages/s and latency")
    o.add_argument("--clients", type=int, default=1000)
    o.add_argument("--client-procs", type=int, default=1, help="processes sharing the clients")
    o.add_argument("--api-threads", type=int, default=0, help="default: clients + 200")
    o.add_argument("--rows", type=int, default=100, help="rows of the view (its snapshot)")
    o.add_argument("--rates", type=float, nargs="+", default=[2, 5, 10, 20])
    o.add_argument("--duration", type=float, default=30)
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument("--idle", type=float, default=10, help="seconds measured with clients idle")
    args = parser.parse_args()
    result = freshness(args) if args.which == "freshness" else fanout(args)
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
