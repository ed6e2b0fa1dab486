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

idle-sockets: cdc and api processes; N subscribers (10,000 by default) of a filter no row
matches, in a few client processes; the API's memory per socket, and the p99 of REST reads of
one row beside them against without them (medians of 3 rounds, each with a fresh API process).
It measures the serving model `make run` uses; another with e.g. `LOGFOLD_API_WORKER=gthread`.
Each round also starts a twin API process that gets no sockets, and reads alternate between
the two in blocks of 50 (before the sockets connect and after): the twin's p99 measures the
machine's own noise at the same moments, so `paired` (the holder's p99 over the twin's with the
sockets, divided by the same before them) is what holding the sockets costs the process that
holds them, apart from what the clients and the holder's writes cost the shared cores.
`--clients-apart` runs the subscribers' processes on a core of their own, and the API and the
REST client on the others: what the API's sockets cost REST, without the clients' own CPU.

fanout: cdc and api processes only (no events: the changes are plain SQL `UPDATE customers`,
which isolates the push path). N websocket subscribers of `customers` in one or a few client
processes (bench/wsfleet.py), each with a token of its own subject (`fan-<i>`: the API admits
at most `LOGFOLD_WS_MAX_PER_SUBJECT` websockets per subject), then updates at a fixed rate, one
row per transaction; every subscriber should receive every change. Rate 0 updates back to back
on the one writer connection: Logfold's saturation. Latency is from the change's commit time
(its `committed_at`, from the changelog) to receipt, both on this machine's clock; throughput
is messages received by all subscribers per second. CPU of each process tree and the API's RSS
are read from /proc.

Then, in the same run (Logfold's processes stopped), the ceiling (bench/ws_ceiling.py, unless
`--no-ceiling`): one plain Python process, one thread, no Logfold, Kafka or Postgres, writing
`change` frames of the same size to the same number of sockets of the same fleet at the same
rates (0: as fast as the sockets take them). Its "commit" is when it decides a change. Each
level reports it under `ceiling` and Logfold's figures over its under `logfold/ceiling`.

Settings: the processes the bench starts inherit no `LOGFOLD_*` variable, so the bench passes
its own environment's on (e.g. `LOGFOLD_WS_MAX_PER_SUBJECT=2000 .venv/bin/python bench/live.py
fanout ...`), then its own overrides (`LOGFOLD_API_THREADS`, from `--api-threads`); those that
tie a process to the bench's stack (its secret, topic prefix, partitions, one API worker, log
level, command timeout) stay the stack's. The result shows what was passed
(`process_settings`).
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
from datetime import UTC, datetime
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
from bench.ws_ceiling import Ceiling, change_message
from bench.wsfleet import Fleet
from config.settings import Settings, kafka_consumer_options
from config.topics import Topics
from stack.procs import stop_process, wait_until
from tests.support import HttpApi, Processes, child_env, token


def summary(values: list[float]) -> dict[str, float]:
    """p50/p99/max in ms of durations in seconds."""
    return {
        "p50_ms": percentile(values, 0.5) * 1e3,
        "p99_ms": percentile(values, 0.99) * 1e3,
        "max_ms": max(values) * 1e3 if values else float("nan"),
    }


def ws_url(api_url: str, query: str | None = None) -> str:
    """The API's websocket URL; `query` (default: a token of subject "tester") follows it."""
    query = query if query is not None else "?token=" + token("views:read")
    return api_url.replace("http://", "ws://", 1) + "/ws" + query


def process_env(settings: Settings, overrides: dict[str, str]) -> dict[str, str]:
    """Settings for the processes the bench starts, which inherit no `LOGFOLD_*` variable:
    the bench's own `LOGFOLD_*` environment, then `overrides`. Those that tie a process to
    the bench's stack (`child_env`'s: its secret, topics, one API worker...) stay the stack's,
    or its processes could not work together."""
    own = child_env(settings)
    env = {k: v for k, v in os.environ.items() if k.startswith("LOGFOLD_") and k not in own}
    return env | overrides


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
            **kafka_consumer_options(),
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
        env = process_env(settings, {})
        procs = Processes(settings, stack.work, env)
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
                "process_settings": env,
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

SUBSCRIBE = {"op": "subscribe", "id": "s", "view": "customers", "filter": {}}
MEDIANS = ("delivered_per_s", "delivered_ratio", "p50_ms", "p99_ms")


def fanout(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        api_threads = args.api_threads or args.clients + 200
        env = process_env(settings, {"LOGFOLD_API_THREADS": str(api_threads)})
        procs = Processes(settings, stack.work, env)
        fleets: list[Fleet] = []
        try:
            keys = _seed(settings, args.rows)
            cdc = procs.cdc()
            api_proc, url = procs.api()
            probe = Watcher(url)  # also waits until the hub has read the changelogs
            probe.subscribe("probe", "customers", {"name": "nobody"}, timeout=180)
            probe.close()
            no_clients_rss = rss_mib(tree(api_proc.pid))

            queries = _subscriber_queries(args.clients)
            fleets, connected, connect_s = _connect(
                [ws_url(url, q) for q in queries], args.client_procs
            )
            roots = stack.infrastructure() | {"api": api_proc.pid, "cdc": cdc.pid}
            meter = CpuMeter(roots | _fleet_roots(fleets), alone=("bench",))
            api_tree = tree(api_proc.pid)
            meter.start()
            time.sleep(args.idle)
            idle = {
                "api_rss_mib_before_clients": no_clients_rss,
                "api_rss_mib": rss_mib(api_tree),
                "api_threads": threads(api_tree),
                "cpu": _clients_total(meter.stop()),
            }

            levels: list[dict[str, Any]] = []
            records: list[Record] = []
            for rate in tqdm(args.rates, desc="rates (logfold)", unit="level"):
                runs = []
                for _ in range(args.repeats):
                    run, records = _logfold_run(
                        settings, fleets, meter, api_proc.pid, keys, rate, args.duration
                    )
                    runs.append(run)
                levels.append({"changes_per_s": rate, **_medians_of(runs, "api_rss_peak_mib")})
                levels[-1]["runs"] = runs
            for fleet in fleets:
                fleet.close()
            fleets = []
            procs.stop()  # the ceiling runs on a quiet machine (Kafka and Postgres idle)
            if args.ceiling:
                ceiling = _ceiling_levels(args, queries, records)
                for level, top in zip(levels, ceiling, strict=True):
                    level["ceiling"] = top
                    level["logfold/ceiling"] = _ratios(level, top)
            return {
                "benchmark": "live-fanout",
                "view": "customers (unfiltered)",
                "subscribers": args.clients,
                "connected": connected,
                "client_processes": args.client_procs,
                "api_threads_setting": api_threads,
                "process_settings": env,
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


# -- idle sockets -----------------------------------------------------------------------------

IDLE_SUBSCRIBE = {"op": "subscribe", "id": "s", "view": "customers", "filter": {"name": "idle"}}


def idle_sockets(args: argparse.Namespace) -> dict[str, Any]:
    """N subscribers that get nothing (a filter no row matches) on one API process: the
    process's memory per socket, and REST's latency beside them against without them. Each
    round starts a fresh API process (memory freed by a round's sockets would hide the next
    one's); the figures are the rounds' medians."""
    stack = Stack()
    with stack as settings:
        env = process_env(settings, {})  # LOGFOLD_API_WORKER and co. from the bench's environment
        procs = Processes(settings, stack.work, env)
        try:
            keys = _seed(settings, args.rows)
            procs.cdc()
            rounds = [_idle_round(procs, keys, args) for _ in tqdm(range(args.repeats), "rounds")]
        finally:
            procs.stop()
    paired = statistics.median(r["paired_p99_ratio"] for r in rounds)
    without = statistics.median(r["rest_p99_ms_without"] for r in rounds)
    with_sockets = statistics.median(r["rest_p99_ms_with"] for r in rounds)
    unread = statistics.median(r["rest_p99_ms_with_clients_not_reading"] for r in rounds)
    return {
        "benchmark": "live-idle-sockets",
        "process_settings": env,
        "subscribers": args.clients,
        "connected": min(r["connected"] for r in rounds),
        "open_at_the_end": min(r["open_at_the_end"] for r in rounds),
        "kib_per_socket": statistics.median(r["kib_per_socket"] for r in rounds),
        "api_threads": max(r["api_threads"] for r in rounds),
        "rest_p99_ms_without": without,
        "rest_p99_ms_with": with_sockets,
        "rest_p99_with/without": with_sockets / without,
        "rest_p99_ms_with_clients_not_reading": unread,
        "rest_p99_with_clients_not_reading/without": unread / without,
        "paired_p99_ratio": paired,
        "rounds": rounds,
    }


def _idle_round(procs: Processes, keys: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One fresh API process: REST's p99 alone, then with `args.clients` idle subscribers;
    each time beside a twin process without sockets, read alternately."""
    api_proc, url = procs.api()
    twin_proc, twin_url = procs.api()
    fleets: list[Fleet] = []
    clients = None
    if args.clients_apart:  # the clients on the last core; the API and this process on the others
        cores = list(range(os.cpu_count() or 1))  # (this process may be pinned already)
        if len(cores) < 2:
            raise SystemExit("--clients-apart needs at least two cores")
        clients, others = {cores[-1]}, set(cores[:-1])
        for pid in [*tree(api_proc.pid), *tree(twin_proc.pid), os.getpid()]:
            _pin(pid, others)
    try:
        for ready in (url, twin_url):
            probe = Watcher(ready)
            probe.subscribe("probe", "customers", {"name": "nobody"}, timeout=180)
            probe.close()
        without, twin_before = _rest_p99s([url, twin_url], keys, args.requests)
        rss_before = rss_mib(tree(api_proc.pid))
        urls = [ws_url(url, q) for q in _subscriber_queries(args.clients)]
        fleets, connected, connect_s = _connect(urls, args.client_procs, IDLE_SUBSCRIBE, clients)
        rss_with = rss_mib(tree(api_proc.pid))
        with_sockets, twin_beside = _rest_p99s([url, twin_url], keys, args.requests)
        # The same with the clients not reading meanwhile (the API still sends every heartbeat):
        # what their own CPU, on the cores the API and this process share, adds.
        for fleet in fleets:
            fleet.ask("pause")
        (with_unread,) = _rest_p99s([url], keys, args.requests)
        for fleet in fleets:
            fleet.ask("resume")
        open_now = sum(f.ask("status")["snapshots"] - f.ask("status")["closed"] for f in fleets)
        return {
            "connected": connected,
            "open_at_the_end": open_now,
            "connect_and_snapshot_s": connect_s,
            "api_rss_mib_without": rss_before,
            "api_rss_mib_with": rss_with,
            "kib_per_socket": (rss_with - rss_before) * 1024 / max(connected, 1),
            "api_threads": threads(tree(api_proc.pid)),
            "rest_p99_ms_without": without,
            "rest_p99_ms_with": with_sockets,
            "rest_p99_ms_with_clients_not_reading": with_unread,
            "twin_rest_p99_ms_before": twin_before,
            "twin_rest_p99_ms_beside": twin_beside,
            "paired_p99_ratio": (with_sockets / twin_beside) / (without / twin_before),
        }
    finally:
        for fleet in fleets:
            fleet.close()
        for proc in (api_proc, twin_proc):
            procs.procs.remove(proc)
            stop_process(proc)


BLOCK = 50  # reads of one process before the next process's, when reading several


def _rest_p99s(urls: list[str], keys: list[str], requests_: int) -> list[float]:
    """p99 in ms of `requests_` reads of one row each from each of `urls`, one after another,
    alternating between them every BLOCK reads."""
    sessions = [requests.Session() for _ in urls]
    for session in sessions:
        session.headers["Authorization"] = f"Bearer {token('views:read')}"
    times: list[list[float]] = [[] for _ in urls]
    for i in range(requests_ * len(urls)):
        which = (i // BLOCK) % len(urls)
        t = time.perf_counter()
        key = keys[i % len(keys)]
        response = sessions[which].get(f"{urls[which]}/views/customers/{key}", timeout=30)
        times[which].append(time.perf_counter() - t)
        response.raise_for_status()
    for session in sessions:
        session.close()
    return [percentile(t, 0.99) * 1e3 for t in times]


def _subscriber_queries(clients: int) -> list[str]:
    """Each subscriber's query string: a token of its own subject (`fan-<i>`), so that the
    API's per-subject websocket limit (`LOGFOLD_WS_MAX_PER_SUBJECT`) admits every one."""
    return [f"?token={token('views:read', subject=f'fan-{i}')}" for i in range(clients)]


def _connect(
    urls: list[str],
    procs: int,
    subscribe: dict[str, Any] = SUBSCRIBE,
    cpus: set[int] | None = None,
) -> tuple[list[Fleet], int, float]:
    """Fleets of `procs` client processes sharing `urls` (a subscriber each), run on `cpus`
    when given; once every subscriber has its snapshot: (the fleets, sockets opened, seconds it
    took)."""
    fleets = [Fleet(urls[i::procs], subscribe) for i in range(procs)]
    for fleet in fleets if cpus else []:
        _pin(fleet.pid, cpus)
    t = time.monotonic()
    for fleet in fleets:
        fleet.control.send("connect")
    connected = sum(fleet.control.recv() for fleet in fleets)
    wait_until(
        lambda: sum(f.ask("status")["snapshots"] for f in fleets) == len(urls),
        300,
        "every subscriber's snapshot",
        interval=1,
    )
    return fleets, connected, time.monotonic() - t


def _pin(pid: int, cpus: set[int]) -> None:
    """Run every thread of process `pid` on `cpus` only."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def _fleet_roots(fleets: list[Fleet]) -> dict[str, int]:
    """The fleets' processes and the bench's own, for a CPU meter."""
    return {f"clients{i}": f.pid for i, f in enumerate(fleets)} | {"bench": os.getpid()}


def _seed(settings: Settings, rows: int) -> list[str]:
    keys = [f"fan-{i:05d}" for i in range(rows)]
    with psycopg.connect(settings.database()) as conn:
        conn.cursor().executemany(
            "INSERT INTO customers (customer_id, name, email, registered_at, version) "
            "VALUES (%s, 'fan', %s, now(), 0)",
            [(k, f"{k}@example.com") for k in keys],
        )
    return keys


def _logfold_run(
    settings: Settings,
    fleets: list[Fleet],
    meter: CpuMeter,
    api_pid: int,
    keys: list[str],
    rate: float,
    duration: float,
) -> tuple[dict[str, Any], list[Record]]:
    """One run on Logfold: updates at `rate` (0: as fast as one writer connection goes);
    its figures, and the changelog records the bench's own consumer saw (their rows are the
    ceiling's)."""
    tap = Tap(settings, "customers")
    open_before = _reset(fleets)
    peak = [0.0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            peak[0] = max(peak[0], rss_mib(tree(api_pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    meter.start()
    writes = _updates(settings, keys, rate, duration)
    _await_delivery(fleets, writes * open_before)
    cpu = _clients_total(meter.stop())
    sampling.set()
    sampler.join()
    time.sleep(0.5)
    records = tap.stop()
    committed = {r.position: r.committed_at for r in records}
    result = {
        "changes_per_s": rate,
        "writes": writes,
        "written_per_s": writes / duration,
        **_receipts(fleets, committed, writes * open_before),
        "subscribers": open_before,
        "message_bytes": _message_bytes(records),
        # for comparison: commit -> a plain Kafka consumer of the changelog (as the hub's)
        "commit_to_consumer": summary([r.read_at - r.committed_at for r in records]),
        "api_rss_peak_mib": peak[0],
        "cpu": cpu,
    }
    return result, records


def _updates(settings: Settings, keys: list[str], rate: float, duration: float) -> int:
    """`UPDATE customers`, one row per transaction on one connection (commits in order), at
    `rate` per second, open loop; or, with rate 0, back to back: one writer's saturation."""
    writes = [0]
    lock = threading.Lock()
    with psycopg.connect(settings.database(), autocommit=True) as conn:

        def update(i: int, _: float) -> None:
            with lock:
                conn.execute(
                    "UPDATE customers SET version = version + 1 WHERE customer_id = %s",
                    (keys[i % len(keys)],),
                )
                writes[0] += 1

        if rate > 0:
            open_loop(rate, duration, update)
        else:
            end = time.time() + duration
            while time.time() < end:
                update(writes[0], 0)
    return writes[0]


def _reset(fleets: list[Fleet]) -> int:
    """Forget what the fleets received; the subscribers open now."""
    for fleet in fleets:
        fleet.ask("reset")
    statuses = [f.ask("status") for f in fleets]
    return sum(s["snapshots"] - s["closed"] for s in statuses)


def _await_delivery(fleets: list[Fleet], expected: int) -> None:
    """Until the fleets hold `expected` changes, or nothing more came for 10 s."""
    last, still = -1, time.monotonic()
    while time.monotonic() - still < 10:
        got = sum(f.ask("status")["changes"] for f in fleets)
        if got >= expected:
            return
        if got != last:
            last, still = got, time.monotonic()
        time.sleep(0.2)


def _receipts(fleets: list[Fleet], committed: dict[str, float], expected: int) -> dict[str, Any]:
    """The fleets' receipts joined by position with each change's commit time: delivered
    ratio and rate, latency, and what else the subscribers got."""
    latencies: list[float] = []
    kinds: dict[str, int] = {}
    closes: dict[str, int] = {}
    first, last_receipt, received, unknown = float("inf"), 0.0, 0, 0
    for fleet in fleets:
        got = fleet.ask("collect")
        for k, n in got["kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
        for k, n in got["closes"].items():
            closes[k] = closes.get(k, 0) + n
        for position, times in got["times"].items():
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
        "expected": expected,
        "received": received,
        "unmatched": unknown,
        "delivered_ratio": received / expected if expected else float("nan"),
        "delivered_per_s": received / span if span > 0 else float("nan"),
        "first_commit_to_last_receipt_s": span,
        **summary(latencies),
        "other_messages": kinds,
        "closes": closes,
    }


def _message_bytes(records: list[Record]) -> int:
    """The size of the `change` Logfold sends the fleet for a changelog record (its last)."""
    for r in reversed(records):
        if r.row is not None:
            return len(change_message("s", r.row, r.position))
    return 0


def _medians_of(runs: list[dict[str, Any]], *more: str) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in (*MEDIANS, *more)}


def _ratios(logfold: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, float]:
    """Logfold's figure over the ceiling's, for each median figure."""
    return {
        k: logfold[k] / ceiling[k] if ceiling[k] else float("nan")
        for k in ("delivered_per_s", "p50_ms", "p99_ms")
    }


# -- the ceiling ----------------------------------------------------------------------------


def _ceiling_levels(
    args: argparse.Namespace, queries: list[str], records: list[Record]
) -> list[dict[str, Any]]:
    """The same fleet, subscriber count, rates and durations against `ws_ceiling.py`: one
    plain process writing frames of the same size as Logfold's to the same sockets."""
    rows = [r.row for r in records if r.row is not None][-args.rows :] or _rows_like_seed(args.rows)
    lsn = max((int(r.position.partition(".")[0]) for r in records), default=10**8)
    ceiling = Ceiling()
    fleets: list[Fleet] = []
    try:
        fleets, connected, connect_s = _connect(
            [ceiling.url(q) for q in queries], args.client_procs
        )
        meter = CpuMeter({"ceiling": ceiling.pid} | _fleet_roots(fleets), alone=("bench",))
        levels = []
        for rate in tqdm(args.rates, desc="rates (ceiling)", unit="level"):
            runs = [
                _ceiling_run(ceiling, fleets, meter, rows, lsn, rate, args.duration)
                for _ in range(args.repeats)
            ]
            level = {"connected": connected, "connect_and_snapshot_s": connect_s}
            levels.append(level | _medians_of(runs) | {"runs": runs})
        return levels
    finally:
        for fleet in fleets:
            fleet.close()
        ceiling.close()


def _ceiling_run(
    ceiling: Ceiling,
    fleets: list[Fleet],
    meter: CpuMeter,
    rows: list[dict[str, Any]],
    lsn: int,
    rate: float,
    duration: float,
) -> dict[str, Any]:
    open_before = _reset(fleets)
    meter.start()
    pushed = ceiling.ask("push", rate=rate, duration=duration, rows=rows, lsn=lsn)
    _await_delivery(fleets, pushed["sent"] * open_before)
    cpu = _clients_total(meter.stop())
    return {
        "changes_per_s": rate,
        "sent": pushed["sent"],
        "sent_per_s": pushed["sent"] / duration,
        **_receipts(fleets, pushed["decided"], pushed["sent"] * open_before),
        "subscribers": open_before,
        "message_bytes": pushed["message_bytes"],
        "cpu": cpu,
    }


def _rows_like_seed(rows: int) -> list[dict[str, Any]]:
    """Rows shaped as the seeded ones, should the changelog have shown none."""
    now = datetime.now(UTC).isoformat()
    return [
        {
            "customer_id": f"fan-{i:05d}",
            "name": "fan",
            "email": f"fan-{i:05d}@example.com",
            "registered_at": now,
            "version": 1,
        }
        for i in range(rows)
    ]


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


def positive(text: str) -> float:
    """A rate of an open loop: more than 0 per second."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive rate")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    f = sub.add_parser("freshness", help="command 201 -> change on a websocket, at several rates")
    f.add_argument("--rates", type=positive, nargs="+", default=[5, 20, 50], help="commands/s")
    f.add_argument("--duration", type=float, default=60)
    f.add_argument("--repeats", type=int, default=3)
    o = sub.add_parser("fanout", help="many subscribers of one view: messages/s and latency")
    o.add_argument("--clients", type=int, default=1000)
    o.add_argument("--client-procs", type=int, default=1, help="processes sharing the clients")
    o.add_argument("--api-threads", type=int, default=0, help="default: clients + 200")
    o.add_argument("--rows", type=int, default=100, help="rows of the view (its snapshot)")
    o.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[2, 5, 10, 20],
        help="changes/s; 0: as fast as one writer goes (Logfold) or the sockets take (ceiling)",
    )
    o.add_argument("--duration", type=float, default=30)
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument("--idle", type=float, default=10, help="seconds measured with clients idle")
    o.add_argument(
        "--ceiling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure bench/ws_ceiling.py with the same fleet and rates",
    )
    i = sub.add_parser(
        "idle-sockets",
        help="many idle subscribers on one API process: memory per socket, REST p99 beside them",
    )
    i.add_argument("--clients", type=int, default=10_000)
    i.add_argument("--client-procs", type=int, default=4, help="processes sharing the clients")
    i.add_argument("--rows", type=int, default=100, help="rows of the view REST reads")
    i.add_argument("--requests", type=int, default=1000, help="REST reads per measure")
    i.add_argument("--repeats", type=int, default=3, help="rounds, each with a fresh API process")
    i.add_argument(
        "--clients-apart",
        action="store_true",
        help="the subscribers' processes on a core of their own (as on other machines), the API "
        "and the REST client on the others",
    )
    args = parser.parse_args()
    run = {"freshness": freshness, "fanout": fanout, "idle-sockets": idle_sockets}[args.which]
    result = run(args)
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
