"""Read-side benchmarks on the full local stack (real Kafka, Postgres, Spark).

    .venv/bin/python bench/read_side.py freshness --rates 10 50 200 --duration 20 --repeats 3
    .venv/bin/python bench/read_side.py rebuild --events 1000000 --repeats 3
    .venv/bin/python bench/read_side.py idle --duration 60 --repeats 3
    .venv/bin/python bench/read_side.py batch --events 200000 --repeats 5
    .venv/bin/python bench/read_side.py stages --rate 40 --duration 30 --repeats 2
    .venv/bin/python bench/read_side.py through-the-api --count 50 --repeats 3
    .venv/bin/python bench/read_side.py first-reads --count 5 --repeats 3

freshness: the whole pipeline (processor, projector, CDC, API) on local Kafka and Postgres.
Commands are posted open-loop at each rate; for every 201 we record when its row is visible: in
`customers` for `register-customer` (a projection: its rows and progress commit in one
transaction) and in the joined `order_summaries` for `place-order` (projection, CDC, join). One
monitor per run polls the view for the pending keys every 10 ms. Each rate is first run for
--warmup seconds (default: --duration), again until the JVMs' JIT compilers (the broker's, the
projector's) are quiet (--settle-jit-pct), recorded apart and not counted: a running stack's
figures, not those of JVMs still compiling what a new rate takes.
The ceiling, measured first in the same run (Kafka and Postgres up, nothing else): records
produced at the same rate into a topic read by a trivial Structured Streaming query (Kafka
source tuned as the projector's, no trigger interval) whose foreachBatch collects the batch and
inserts its keys into a Postgres table; from the producer's ack to the row being visible.

through-the-api: read-your-writes as a client does it, on the whole stack as freshness runs it,
one command at a time: its 201, then a read of its row with `consistent_with` (the API waits
until the view includes the command's position); from the 201 until the API answered, and
until the row was visible in Postgres (watched every 5 ms at the same time): the difference is
what the API's waiting adds. `customers` after `register-customer`, the joined
`order_summaries` after `place-order`.

first-reads: read-your-writes (`register-customer`, then its row in `customers`) right after
the stack started, as the README's first example does, then a few more in a row; a new stack
for each run.

idle: the whole stack as `make run` starts it (processor, projector, CDC, API, Kafka,
Postgres), warmed by one command and caught up, then left alone: CPU used by all its processes,
as a share of one core. A settling minute first, and more while the JVMs' JIT compilers still
work (the broker's C2 goes on for minutes after a start; --settle-jit-pct): those windows are
recorded apart (`settling`), not counted.

rebuild: writes N events of a realistic bookshop mix straight into the event topics, then times
the rebuild of every projection (one read of the log for all, as `rebuild --all`); in the same
run, the bare rate of reading the same records from Kafka with Spark (no decoding), of reading
and decoding them as the rebuild does (nothing kept: Spark's `noop` sink), and of COPYing rows
of the views' width into Postgres, as ceilings.

batch: what one micro-batch of the event pipeline costs in Spark (the job that turns a batch
of records into every view's rows, as the live projector runs it), for a small batch (a few
records, as at tens of commands/s) and for a whole log read at once (as after downtime),
planned as Spark does (generated code, every optimizer rule) and lean (interpreted
expressions, fewer optimizer rules; `spark.session.full_planning`), side by side in one
session; and the Kafka source alone reading one record from each of 12 partitions, by the
consumer's fetch.max.wait.ms.

stages: where a live micro-batch of the event query goes, by Spark's own durations of each
batch (`StreamingQueryProgress.durationMs`: planning, the batch's job and `foreachBatch`, the
two checkpoint files), plus the time the analyser's and optimizer's rules took per batch. The
projector runs in this process, on Kafka and Postgres, while events arrive at --rate per
second; each variant (the code as it is, and the code without one of its per-batch savings)
runs --duration seconds after a warm-up, the variants alternating, --repeats rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from kafka import KafkaProducer
from kafka.admin import NewTopic
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen
from bench.loadgen import percentile
from bench.procstat import CpuMeter
from commands.messages import LogPosition
from config.settings import Settings
from config.topics import Topics
from events.book import BookAdded
from events.customer import CustomerRegistered
from events.order import OrderPaid, OrderPlaced, PlacedLine
from events.partitioning import partition_for
from events.serialization import encode, envelope_for
from stack.local_kafka import LocalKafka
from stack.local_postgres import LocalPostgres
from stack.migrate import upgrade
from stack.procs import free_port, wait_until
from stack.topics import admin_client, create_topics, wait_for_topics
from tests.support import SECRET, HttpApi, Processes, token


class Stack:
    def __init__(self, partitions: int = 4) -> None:
        self.partitions = partitions
        self.work = Path(tempfile.mkdtemp(prefix="logfold-bench-"))
        self.work.chmod(0o755)
        self.kafka = LocalKafka(Path(".stack/lib"), self.work / "kafka", free_port(), free_port())
        self.pg = LocalPostgres(self.work / "pg", free_port())

    def __enter__(self) -> Settings:
        self.kafka.start()
        self.pg.start()
        upgrade(self.pg.url)
        settings = Settings(
            kafka_bootstrap_servers=self.kafka.bootstrap,
            database_url=self.pg.url,
            jwt_secret=SECRET,
            topic_prefix="bench.",
            partitions=self.partitions,
        )
        create_topics(settings)
        return settings

    def infrastructure(self) -> dict[str, int]:
        """The broker's and Postgres's process ids, for CPU meters."""
        assert self.kafka.proc is not None and self.pg.proc is not None
        return {"kafka": self.kafka.proc.pid, "postgres": self.pg.proc.pid}

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        self.pg.stop()
        self.kafka.stop()
        # The broker's log, the database and the processes' logs: gigabytes after a rebuild.
        if error is None:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            print(f"logs kept in {self.work}", file=sys.stderr)


def start_processes(
    stack: Stack, procs: Processes, background: bool = True
) -> tuple[str, CpuMeter]:
    """An API process and, with `background`, a processor, the projector and CDC: the API's
    URL and a CPU meter of every process of the stack (and of this one, `bench`)."""
    roots: dict[str, int] = {}
    if background:
        roots |= {
            "processor": procs.processor().pid,
            "projector": procs.projector().pid,
            "cdc": procs.cdc().pid,
        }
    api_proc, url = procs.api()
    roots |= stack.infrastructure() | {"api": api_proc.pid, "bench": os.getpid()}
    return url, CpuMeter(roots, alone=("bench",))


def start_warmed(stack: Stack, procs: Processes) -> tuple[HttpApi, CpuMeter]:
    """Every process of the stack (`start_processes`), returned once the API answers and, as
    `make run` waits for before its banner, every projection and join is warmed and started."""
    settings = procs.settings
    with psycopg.connect(settings.database()) as conn:
        (spawned,) = conn.execute("SELECT now()").fetchone() or (None,)
    url, meter = start_processes(stack, procs)
    procs.wait_processing(url, 1)
    wait_until(lambda: started(settings, spawned), 300, "the projector's warm-up")
    return HttpApi(url, token()), meter


def freshness(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(args.partitions)
    with stack as settings:
        ceiling = [
            {
                "offered_per_s": rate,
                **trivial_query(settings, rate, args.duration, args.repeats, warmup(args)),
            }
            for rate in args.rates
        ]
        # INFO: the projector logs each batch's timings, for reading the results.
        procs = Processes(settings, stack.work, {"LOGFOLD_LOG_LEVEL": "INFO", **extra(args)})
        try:
            api, meter = start_warmed(stack, procs)
            url = api.base_url
            first_reads = [read_your_write(settings, api) for _ in range(5)]
            book, buyers = warm_up(settings, api)
            views: dict[str, Any] = {
                "customers": (
                    lambda _: ("register-customer", {"name": "n", "email": "n@example.com"}),
                    "SELECT customer_id FROM customers WHERE customer_id = ANY(%s)",
                ),
                "order_summaries": (
                    lambda i: (
                        "place-order",
                        {
                            "customer_id": buyers[i % len(buyers)],
                            "lines": [{"book_id": book, "quantity": 1}],
                        },
                    ),
                    "SELECT order_id FROM order_summaries WHERE order_id = ANY(%s)",
                ),
            }
            result: dict[str, Any] = {
                "benchmark": "freshness",
                "ceiling": ceiling,
                "first_reads_after_start_ms": first_reads,
            }
            for view in args.views:
                command, sql = views[view]
                levels = []
                for rate in tqdm(args.rates, desc=view, unit="level"):
                    for subscribes in args.subscribes_per_s:
                        run = partial(
                            subscribed_run, settings, url, rate, subscribes, command, sql, meter
                        )
                        runs = settled(run, warmup(args), args.settle_jit_pct, args.max_warmups)
                        runs += [run(args.duration) for _ in range(args.repeats)]
                        counted = runs[-args.repeats :]
                        levels.append(
                            {
                                "offered_per_s": rate,
                                "subscribes_per_s": subscribes,
                                "p50_ms": statistics.median(r["p50_ms"] for r in counted),
                                "p99_ms": statistics.median(r["p99_ms"] for r in counted),
                                "runs": counted,
                                "warmup": runs[: -args.repeats],
                            }
                        )
                result[view] = levels
            return result
        finally:
            procs.stop()


def subscribed_run(
    settings: Settings,
    url: str,
    rate: float,
    subscribes: float,
    command: Any,
    sql: str,
    meter: CpuMeter,
    seconds: float,
) -> dict[str, Any]:
    """One `open_loop` run of `command` while a client subscribes `subscribes` times a second."""
    with Subscribing(url, subscribes) as subscribing:
        found = open_loop(settings, rate, seconds, posting(url, command), sql, meter)
    return {**found, "snapshots": subscribing.snapshots}


class Subscribing:
    """While open: websocket subscribes to `customers` (a snapshot of one customer's row, then
    unsubscribe) at `rate` per second, as clients arriving do; counts the snapshots received.
    Each snapshot is a transaction on the table the projector writes."""

    def __init__(self, api_url: str, rate: float) -> None:
        self.url = api_url.replace("http://", "ws://") + "/ws"
        self.rate, self.snapshots = rate, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Subscribing:
        if self.rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        import websocket

        ws = websocket.create_connection(f"{self.url}?token={token('views:read')}", timeout=30)
        try:
            start, i = time.perf_counter(), 0
            while not self._stop.is_set():
                delay = start + i / self.rate - time.perf_counter()
                if delay > 0 and self._stop.wait(delay):
                    break
                sub = f"s{i}"
                ws.send(
                    json.dumps(
                        {
                            "op": "subscribe",
                            "id": sub,
                            "view": "customers",
                            "filter": {"name": "b0"},
                        }
                    )
                )
                while True:
                    message = json.loads(ws.recv())
                    if message.get("id") == sub and message["type"] in ("snapshot", "error"):
                        self.snapshots += message["type"] == "snapshot"
                        break
                ws.send(json.dumps({"op": "unsubscribe", "id": sub}))
                i += 1
        finally:
            ws.close()


def extra(args: argparse.Namespace) -> dict[str, str]:
    """`--set KEY=VALUE` settings for the stack's processes (e.g. LOGFOLD_SPARK_IDLE_POLL_MS)."""
    return dict(item.split("=", 1) for item in args.set)


def started(settings: Settings, since: Any) -> bool:
    from projections.registry import FOLDS

    with psycopg.connect(settings.database()) as conn:
        sql = "SELECT projection FROM projection_progress WHERE started_at >= %s"
        return {r[0] for r in conn.execute(sql, (since,))} >= set(FOLDS)


def read_your_write(settings: Settings, api: HttpApi) -> float:
    """One `register-customer`, then ms from its 201 until its row is in `customers`."""
    r = api.command("register-customer", {"name": "first", "email": "first@example.com"})
    acked, cid = time.perf_counter(), r.body["aggregate_id"]
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        sql = "SELECT 1 FROM customers WHERE customer_id = %s"
        while conn.execute(sql, (cid,)).fetchone() is None:
            if time.perf_counter() - acked > 60:
                raise TimeoutError(f"customer {cid} not visible after 60 s")
            time.sleep(0.005)
    return (time.perf_counter() - acked) * 1e3


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


def warm_up(settings: Settings, api: HttpApi) -> tuple[str, list[str]]:
    """A book and 20 customers, all in their views and joined, before the clock starts."""
    book = api.command(
        "add-book",
        {"title": "Emma", "author": "Austen", "price_cents": 999, "royalty_rate": 0.1},
    ).body["aggregate_id"]
    buyers = [
        api.command("register-customer", {"name": f"b{i}", "email": f"b{i}@example.com"}).body[
            "aggregate_id"
        ]
        for i in range(20)
    ]
    order = api.command(
        "place-order", {"customer_id": buyers[0], "lines": [{"book_id": book, "quantity": 1}]}
    ).body["aggregate_id"]

    def joined() -> bool:
        with psycopg.connect(settings.database()) as conn:
            sql = "SELECT 1 FROM order_summaries WHERE order_id = %s AND customer_name IS NOT NULL"
            return conn.execute(sql, (order,)).fetchone() is not None

    wait_until(joined, 300, "the projector, CDC and the join")
    return book, buyers


def posting(url: str, command: Any) -> Drive:
    """Post the i-th command (`command(i)` -> name, data) at the rate, from the light open-loop
    generator (`bench/loadgen.py`: asyncio, keep-alive connections), which leaves the two
    cores to the stack; a thread and an HTTP client per request took a third of a core at
    200/s. Each 201 reports its aggregate id when its answer arrived."""

    def body(i: int) -> tuple[str, bytes]:
        name, data = command(i)
        return f"/commands/{name}", json.dumps({"data": data}).encode()

    def drive(rate: float, duration: float, sent: Sent) -> None:
        def answered(_: int, status: int, answer: bytes) -> None:
            acked = time.perf_counter()
            sent(json.loads(answer)["aggregate_id"] if status == 201 else None, acked)

        # As many connections as the threads of the client this replaced.
        loadgen.offered_load([url], token(), body, rate, duration, 64, answered)

    return drive


def threaded(send: Callable[[int], tuple[str, float] | None]) -> Drive:
    """Call `send(i)` (-> key and when it was acked, or None on a failure) at the rate, from
    a pool of threads."""

    def drive(rate: float, duration: float, sent: Sent) -> None:
        start = time.perf_counter() + 0.2

        def one(i: int) -> None:
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            answer = send(i)
            sent(*(answer or (None, time.perf_counter())))

        with ThreadPoolExecutor(max_workers=64) as pool:
            list(pool.map(one, range(int(rate * duration))))

    return drive


def warmup(args: argparse.Namespace) -> float:
    """Seconds of load at a rate before its measured runs. The first run at a new rate is
    the slowest (`customers` at 50/s, six runs of 45 s: p50 347 ms, then 233-280 ms): the
    JVMs, the broker's above all, are still compiling the paths that rate takes."""
    return float(args.duration if args.warmup is None else args.warmup)


def settled(
    run: Callable[[float], dict[str, Any]], seconds: float, jit_pct: float, most: int
) -> list[dict[str, Any]]:
    """Warm-up runs of `seconds` each, until the stack's JVMs have stopped compiling: their
    JIT compiler threads used under `jit_pct` % of a core in the last run (at most `most`
    runs). The broker's C2 compiler goes on for minutes after a start: at ~32 transactions/s
    a transaction cost a new broker 17.4, 7.7 and 4.0 ms of CPU in its first three
    half-minutes, the compiler 9.2, 3.7 and 0.4 ms of it (`bench/commands.py transactions`)."""
    runs: list[dict[str, Any]] = []
    while seconds and len(runs) < most:
        runs.append(run(seconds))
        cpu = runs[-1].get("cpu_pct", {})
        if sum(v for k, v in cpu.items() if k.endswith("_jit_pct")) < jit_pct:
            break
    return runs


def trivial_query(
    settings: Settings, rate: float, duration: float, repeats: int, warmup: float = 0
) -> dict[str, Any]:
    """The ceiling: produce -> trivial streaming query -> Postgres, at `rate` (see the doc),
    after `warmup` seconds of the same load that are not counted."""
    from pyspark.sql import DataFrame

    from spark.decode import kafka_options
    from spark.session import session

    topic = f"{settings.topic_prefix}ceiling.{uuid.uuid4().hex[:6]}"
    admin = admin_client(settings)
    try:  # the local broker does not create topics on first use
        admin.create_topics([NewTopic(topic, 1, settings.replication_factor)])
        wait_for_topics(admin, [topic], timeout_s=30.0)
    finally:
        admin.close()
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS ceiling (k text PRIMARY KEY)")

    def sink(batch: DataFrame, _: int) -> None:
        keys = [r[0] for r in batch.selectExpr("CAST(key AS STRING)").collect()]
        if keys:
            with psycopg.connect(settings.database()) as conn, conn.transaction():
                conn.execute(
                    "INSERT INTO ceiling SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING", (keys,)
                )

    spark = session(settings, "logfold-bench-ceiling")
    records = (
        spark.readStream.format("kafka")
        .options(**kafka_options(settings.kafka()))
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .load()
    )
    producer = KafkaProducer(bootstrap_servers=settings.kafka(), acks="all")
    warm = f"warm-{topic}"
    producer.send(topic, key=warm.encode(), value=b"x").get(timeout=30)
    query = (
        records.writeStream.foreachBatch(sink)
        .option("checkpointLocation", tempfile.mkdtemp(prefix="logfold-ceiling-"))
        .start()
    )
    try:
        wait_until(lambda: visible(settings, warm), 120, "the trivial query")

        def send(i: int) -> tuple[str, float]:
            key = uuid.uuid4().hex
            producer.send(topic, key=key.encode(), value=b"x").get(timeout=30)
            return key, time.perf_counter()

        warm = [open_loop(settings, rate, warmup, threaded(send), CEILING_SQL)] if warmup else []
        runs = [
            open_loop(settings, rate, duration, threaded(send), CEILING_SQL) for _ in range(repeats)
        ]
        return {
            "p50_ms": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            "runs": runs,
            "warmup": warm,
        }
    finally:
        query.stop()
        producer.close()
        spark.stop()


CEILING_SQL = "SELECT k FROM ceiling WHERE k = ANY(%s)"


def visible(settings: Settings, key: str) -> bool:
    with psycopg.connect(settings.database()) as conn:
        return conn.execute(CEILING_SQL, ([key],)).fetchone() is not None


Sent = Callable[[str | None, float], None]  # a key (None: the request failed), when acked
Drive = Callable[[float, float, Sent], None]  # rate, duration, where each answer goes


def open_loop(
    settings: Settings,
    rate: float,
    duration: float,
    drive: Drive,
    sql: str,
    meter: CpuMeter | None = None,
) -> dict[str, Any]:
    """Run `drive` (`threaded` or `posting`) at `rate` for `duration` s; the latency of each
    key it reports until `sql` (keys = ANY(%s)) finds it."""
    pending: dict[str, float] = {}
    lags: list[float] = []
    failed = total = 0
    lock, done, give_up = threading.Lock(), threading.Event(), threading.Event()

    def monitor() -> None:
        with psycopg.connect(settings.database(), autocommit=True) as conn:
            while not (done.is_set() and not pending) and not give_up.is_set():
                with lock:
                    keys = list(pending)
                if keys:
                    found = conn.execute(sql, (keys,)).fetchall()
                    now = time.perf_counter()
                    with lock:
                        for (k,) in found:
                            lags.append(now - pending.pop(k))
                time.sleep(0.01)

    def sent(key: str | None, acked: float) -> None:
        nonlocal failed, total
        with lock:
            total += 1
            if key is None:
                failed += 1
            else:
                pending[key] = acked

    watcher = threading.Thread(target=monitor)
    watcher.start()
    if meter:
        meter.start()
    drive(rate, duration, sent)
    done.set()
    watcher.join(timeout=300)
    give_up.set()  # what is still pending counts as not visible
    cpu = meter.stop() if meter else {}
    return {
        **({"cpu_pct": {k: round(v, 1) for k, v in cpu.items()}} if cpu else {}),
        "offered_per_s": rate,
        "sent": total,
        "failed": failed,
        "visible": len(lags),
        "p50_ms": percentile(lags, 0.5) * 1e3,
        "p99_ms": percentile(lags, 0.99) * 1e3,
    }


def idle(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        procs = Processes(settings, stack.work, extra(args))
        try:
            procs.cdc()
            procs.processor()
            procs.projector()
            _, url = procs.api()
            procs.wait_processing(url, 1)
            api = HttpApi(url, token())
            first = api.command("register-customer", {"name": "warm", "email": "w@example.com"})
            wait_until(lambda: included(settings, first.body["position"]), 180, "the projector")
            names = ["cdc", "processor", "projector", "api"]
            roots = dict(zip(names, (p.pid for p in procs.procs), strict=True))
            roots.update(stack.infrastructure())
            meter = CpuMeter(roots)

            def window(seconds: float, desc: str) -> dict[str, float]:
                meter.start()
                for _ in tqdm(range(round(seconds)), desc=desc, unit="s", leave=False):
                    time.sleep(1)
                cpu = meter.stop()
                run = {n: cpu[f"{n}_pct"] for n in roots}
                return {
                    "all": sum(run.values()),
                    **run,
                    "jit": sum(cpu[f"{n}_jit_pct"] for n in roots),
                    "others": cpu["others_pct"],
                }

            # Left alone first: the JVMs, the broker's above all, go on compiling what the
            # start-up ran for minutes (C2); measured, not counted, until they are quiet.
            settling = [window(args.settle, "settling")]
            while settling[-1]["jit"] >= args.settle_jit_pct and (
                len(settling) * args.settle < args.max_settle
            ):
                settling.append(window(args.settle, "settling (JIT)"))
            runs = [
                window(args.duration, f"idle {i + 1}/{args.repeats}") for i in range(args.repeats)
            ]
            return {
                "benchmark": "idle",
                "percent_of_one_core": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
                "runs": runs,
                "settling": settling,
            }
        finally:
            procs.stop()


def included(settings: Settings, token_: str) -> bool:
    p = LogPosition.parse(token_)
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT offsets ->> %s FROM projection_progress WHERE projection = 'customers'",
            (f"{p.topic}:{p.partition}",),
        ).fetchone()
    return bool(row and row[0] is not None and int(row[0]) >= p.offset)


def write_log(settings: Settings, events: int, seed: int = 3) -> int:
    """A bookshop log: 5% customers, 1% books, then orders placed and (70%) paid, each event
    occurring as it is written (as the API writes them: none is late for a watermark)."""
    rng = random.Random(seed)
    topics = Topics(settings.topic_prefix)
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(),
        acks="all",
        linger_ms=20,
        batch_size=512 * 1024,
    )
    customers: list[str] = []
    books: list[tuple[str, int, str]] = []
    written = 0

    def send(agg: str, agg_id: str, version: int, event: Any) -> None:
        nonlocal written
        env = envelope_for(
            event,
            event_id=str(uuid.uuid4()),
            aggregate_type=agg,
            aggregate_id=agg_id,
            version=version,
            occurred_at=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            command_id="bench",
            correlation_id="bench",
            causation_id="bench",
        )
        producer.send(
            topics.events(agg),
            key=f"{agg_id}:{version}".encode(),
            value=encode(env),
            partition=partition_for(agg_id, settings.partitions),
        )
        written += 1

    with tqdm(total=events, desc="writing the log", unit="ev") as bar:
        while written < events:
            before = written
            roll = rng.random()
            if roll < 0.05 or not customers:
                cid = str(uuid.uuid4())
                customers.append(cid)
                send("customer", cid, 1, CustomerRegistered(f"C {cid[:6]}", f"{cid[:8]}@x.org"))
            elif roll < 0.06 or not books:
                bid = str(uuid.uuid4())
                books.append((bid, rng.randint(100, 5000), rng.choice("ABCDEFGHIJ")))
                send("book", bid, 1, BookAdded("T", books[-1][2], books[-1][1], 0.1))
            else:
                oid = str(uuid.uuid4())
                lines = tuple(
                    PlacedLine(b, rng.randint(1, 3), p, a, 0.1)
                    for b, p, a in rng.sample(books, k=min(len(books), 2))
                )
                total = sum(x.quantity * x.unit_price_cents for x in lines)
                send("order", oid, 1, OrderPlaced(rng.choice(customers), lines, total))
                if rng.random() < 0.7:
                    send("order", oid, 2, OrderPaid(total, lines))
            bar.update(written - before)
    producer.flush()
    producer.close()
    return written


def rebuild(args: argparse.Namespace) -> dict[str, Any]:
    from projections.registry import PROJECTIONS
    from spark.decode import every_event, parse_events, read_batch
    from spark.rebuild import Rebuild
    from spark.session import session

    with Stack() as settings:
        written = write_log(settings, args.events)
        spark = session(settings, "logfold-bench")
        job = Rebuild(settings, spark)
        topics = Topics(settings.topic_prefix)
        everything = [topics.events(a) for a in ("customer", "book", "order")]
        log = read_batch(spark, settings.kafka(), everything, "earliest", "latest")
        results: dict[str, Any] = {"benchmark": "rebuild", "events_in_log": written}
        for _ in range(args.repeats):
            t = time.perf_counter()
            n = log.count()
            results.setdefault("spark_kafka_read_per_s", []).append(n / (time.perf_counter() - t))
            results.setdefault("copy_rows_per_s", []).append(copy_rate(settings, 200_000))
            t = time.perf_counter()
            reports = job.run_many(list(PROJECTIONS.values()), verify=False, progress=False)
            took = time.perf_counter() - t
            steps = {"read": reports[0].steps["read"]}
            for r in reports:
                steps |= {f"{r.projection} {k}": v for k, v in r.steps.items() if k != "read"}
            for step, seconds in steps.items():
                results.setdefault(f"{step} seconds", []).append(round(seconds, 2))
            results.setdefault("all_views_seconds", []).append(took)
            results.setdefault("all_views_events_per_s", []).append(written / took)
            # The least any rebuild of this log does: read every record and decode it (after
            # the rebuild, so that its first run is not warmed by it).
            t = time.perf_counter()
            every_event(parse_events(log)).write.format("noop").mode("overwrite").save()
            results.setdefault("spark_read_and_decode_per_s", []).append(
                n / (time.perf_counter() - t)
            )
        spark.stop()
        medians = {k: statistics.median(v) for k, v in results.items() if isinstance(v, list)}
        return {**results, "medians": medians}


def batch_cost(args: argparse.Namespace) -> dict[str, Any]:
    from projections.registry import PROJECTIONS
    from spark.decode import every_event, kafka_options, parse_events, read_batch
    from spark.event_sink import EventSink
    from spark.session import full_planning, session

    with Stack() as settings:
        written = write_log(settings, args.events)
        spark = session(settings, "logfold-bench")
        sink = EventSink(list(PROJECTIONS.values()), settings)
        topics = [Topics(settings.topic_prefix).events(a) for a in ("customer", "book", "order")]

        def assigned(options: dict[str, str], parts: list[int], end: int) -> Any:
            """Records 0..end of partitions `parts` of every topic."""
            return (
                spark.read.format("kafka")
                .options(**options)
                .option("assign", json.dumps(dict.fromkeys(topics, parts)))
                .option(
                    "startingOffsets",
                    json.dumps({t: dict.fromkeys(map(str, parts), 0) for t in topics}),
                )
                .option(
                    "endingOffsets",
                    json.dumps({t: dict.fromkeys(map(str, parts), end) for t in topics}),
                )
                .load()
            )

        def batch(first: int | None) -> Any:
            """Records 0..first of partition 0 of every topic, or the whole log."""
            if first is not None:
                return sink.with_rows(
                    every_event(parse_events(assigned(kafka_options(settings.kafka()), [0], first)))
                )
            whole = read_batch(spark, settings.kafka(), topics, "earliest", "latest")
            return sink.with_rows(every_event(parse_events(whole)))

        def seconds(frame: Any) -> float:
            t = time.perf_counter()
            rows, errors = sink._collect(frame, sink.projections, lambda: frame)
            assert rows and not errors, errors
            return time.perf_counter() - t

        results: dict[str, Any] = {"benchmark": "batch", "events_in_log": written}
        sizes = {"small": (batch(2), args.repeats * 6), "whole_log": (batch(None), args.repeats)}
        # Each mode twice, alternating; the first round of each warms the JVM and is not counted.
        for counted, generated in ((False, True), (False, False), (True, True), (True, False)):
            full_planning(spark, generated)
            mode = "full" if generated else "lean"
            for size, (frame, n) in sizes.items():
                taken = [round(seconds(frame) * 1e3, 1) for _ in range(n)]
                if counted:
                    results[f"{size}_{mode}_ms"] = taken
        # The Kafka source alone: one record from each of 12 partitions, by fetch.max.wait.ms.
        parts = list(range(settings.partitions))
        for wait in (10, 0, 10, 0):
            options = {**kafka_options(settings.kafka()), "kafka.fetch.max.wait.ms": str(wait)}
            raw = assigned(options, parts, 1)
            taken = []
            for _ in range(args.repeats * 6):
                t = time.perf_counter()
                raw.collect()
                taken.append(round((time.perf_counter() - t) * 1e3, 1))
            results[f"read_{len(topics) * len(parts)}_partitions_wait_{wait}_ms"] = taken
        medians = {k: statistics.median(v) for k, v in results.items() if isinstance(v, list)}
        for size in sizes:
            medians[f"{size}_lean_over_full"] = (
                medians[f"{size}_lean_ms"] / medians[f"{size}_full_ms"]
            )
        spark.stop()
        return {**results, "medians": medians}


# The per-batch savings `stages` can leave out, one at a time.
STAGE_VARIANTS = {
    "current": {},
    "every optimizer rule": {"lean_rules": ()},
    "FileContext checkpoints": {
        "spark.sql.streaming.checkpointFileManagerClass": (
            "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
        )
    },
}


def stages(args: argparse.Namespace) -> dict[str, Any]:
    import spark.session as spark_session
    from spark.projector import Projector

    with Stack() as settings:
        write_log(settings, 2000)
        spark = spark_session.session(settings, "logfold-bench", settings.projector_java_options)
        rules = spark._jvm.org.apache.spark.sql.catalyst.rules.RuleExecutor  # type: ignore[union-attr]
        lean = spark_session.LEAN_EXCLUDED_RULES
        results: dict[str, Any] = {"benchmark": "stages", "rate_per_s": args.rate}

        def feed(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.monotonic()
                write_log(settings, max(1, int(args.rate / 5)), seed=random.randrange(1 << 30))
                time.sleep(max(0.0, 0.2 - (time.monotonic() - t)))

        for _ in range(args.repeats):
            for name in args.variants:
                variant = STAGE_VARIANTS[name]
                spark_session.LEAN_EXCLUDED_RULES = variant.get("lean_rules", lean)
                key = "spark.sql.streaming.checkpointFileManagerClass"
                spark.conf.set(key, variant.get(key, spark_session.CHECKPOINT_FILE_MANAGER))
                # Micro-batches, whose stages this measures (not the real-time query).
                batches_only = settings.model_copy(update={"spark_realtime": False})
                projector = Projector(batches_only, spark, joins=[])
                runner = threading.Thread(target=projector.run, daemon=True)
                runner.start()
                feed(15)  # warm-up
                query = projector.queries["events"]
                first = query.lastProgress["batchId"] if query.lastProgress else 0
                rules.resetMetrics()
                feed(args.duration)
                progress = [p for p in query.recentProgress if p["batchId"] > first]
                batches = query.lastProgress["batchId"] - first
                # Nanoseconds in every rule since the reset, all queries of this process.
                rule_ms = rules.getCurrentMetrics().time() / 1e6 / max(batches, 1)
                projector.stop()
                runner.join()
                run = {
                    "batches": batches,
                    "rules_ms_per_batch": round(rule_ms, 1),
                    **{
                        f"{k}_ms": statistics.median(p["durationMs"].get(k, 0) for p in progress)
                        for k in (
                            "triggerExecution",
                            "queryPlanning",
                            "addBatch",
                            "walCommit",
                            "commitOffsets",
                        )
                    },
                }
                results.setdefault(name, []).append(run)
        spark_session.LEAN_EXCLUDED_RULES = lean
        spark.stop()
        medians = {
            name: {k: statistics.median(r[k] for r in results[name]) for k in results[name][0]}
            for name in args.variants
        }
        return {**results, "medians": medians}


def copy_rate(settings: Settings, rows: int) -> float:
    """Rows/s of COPY into a table as wide as `orders`."""
    with psycopg.connect(settings.database()) as conn:
        conn.execute("CREATE TEMP TABLE copy_bench (LIKE orders)")
        t = time.perf_counter()
        with conn.cursor().copy("COPY copy_bench FROM STDIN") as copy:
            for i in range(rows):
                copy.write_row(
                    (
                        f"order-{i}",
                        "c",
                        "paid",
                        1999,
                        2,
                        "2026-11-21T10:00:00Z",
                        "2026-11-21T10:01:00Z",
                        None,
                        2,
                    )
                )
        conn.commit()
        return rows / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    f = sub.add_parser("freshness", help="command 201 -> row visible, at several rates")
    f.add_argument("--rates", type=float, nargs="+", default=[10, 50, 200])
    f.add_argument(
        "--views",
        nargs="+",
        default=["customers", "order_summaries"],
        choices=["customers", "order_summaries"],
    )
    f.add_argument("--duration", type=float, default=20)
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of load at each rate before its measured runs, for the ceiling and the "
        "stack alike, recorded but not counted (default: --duration; 0: none)",
    )
    f.add_argument(
        "--settle-jit-pct",
        type=float,
        default=5,
        help="repeat a rate's warm-up run until the JVMs' JIT compilers used less than this "
        "%% of a core in it (a running stack's JVMs have compiled their paths)",
    )
    f.add_argument("--max-warmups", type=int, default=6, help="warm-up runs per rate at most")
    f.add_argument(
        "--partitions", type=int, default=4, help="partitions per topic (`LOGFOLD_PARTITIONS`)"
    )
    f.add_argument(
        "--subscribes-per-s",
        type=float,
        nargs="+",
        default=[0],
        help="websocket subscribes per second to `customers` during each run (one figure per "
        "value, side by side), e.g. 0 50",
    )
    r = sub.add_parser("rebuild", help="replay throughput over a large log")
    r.add_argument("--events", type=int, default=1_000_000)
    r.add_argument("--repeats", type=int, default=3)
    b = sub.add_parser("batch", help="Spark's cost of one event-pipeline batch, small and large")
    b.add_argument("--events", type=int, default=200_000)
    b.add_argument("--repeats", type=int, default=5)
    g = sub.add_parser("stages", help="where a live event-query batch goes, by Spark's stages")
    g.add_argument("--rate", type=float, default=40, help="events per second")
    g.add_argument("--duration", type=float, default=30)
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument(
        "--variants",
        nargs="+",
        default=list(STAGE_VARIANTS),
        choices=list(STAGE_VARIANTS),
        help="which to run (default: all)",
    )
    w = sub.add_parser(
        "through-the-api",
        help="read-your-writes through the API (consistent_with), one command at a time",
    )
    w.add_argument("--count", type=int, default=50, help="commands per run")
    w.add_argument("--repeats", type=int, default=3)
    fr = sub.add_parser("first-reads", help="read-your-writes right after a start, then later")
    fr.add_argument("--count", type=int, default=5, help="reads in a row after each start")
    fr.add_argument("--repeats", type=int, default=3, help="stacks started")
    i = sub.add_parser("idle", help="CPU of the whole stack left alone")
    i.add_argument("--duration", type=float, default=60)
    i.add_argument(
        "--settle",
        type=float,
        default=60,
        help="seconds left alone before measuring, and again while the JVMs still compile",
    )
    i.add_argument(
        "--settle-jit-pct",
        type=float,
        default=1.0,
        help="measure once the JIT compilers used less than this %% of a core while settling",
    )
    i.add_argument("--max-settle", type=float, default=600, help="seconds of settling at most")
    i.add_argument("--repeats", type=int, default=3)
    for p in (f, i, w, fr):
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a setting for the stack's processes, e.g. LOGFOLD_SPARK_IDLE_POLL_MS=50",
        )
    args = parser.parse_args()
    runs = {
        "freshness": freshness,
        "rebuild": rebuild,
        "idle": idle,
        "batch": batch_cost,
        "stages": stages,
        "through-the-api": through_the_api,
        "first-reads": first_reads,
    }
    result = runs[args.which](args)
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
