"""The local stack the read-side benchmarks run on, and what several of them share: starting it
warmed, posting commands open-loop, watching rows become visible, writing a log straight into
Kafka."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from kafka import KafkaProducer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen
from bench.loadgen import percentile
from bench.procstat import CpuMeter
from config.settings import Settings, kafka_client_options
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
from stack.topics import create_topics
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


def write_log(
    settings: Settings, events: int, seed: int = 3, span: timedelta = timedelta(0)
) -> int:
    """A bookshop log: 5% customers, 1% books, then orders placed and (70%) paid, each event
    occurring as it is written (as the API writes them: none is late for a watermark). With a
    `span`, the events occur evenly over that time up to now, each appended as it occurs (its
    record's time is its event time), as a shop's log of that long would be."""
    rng = random.Random(seed)
    start = datetime.now(UTC) - span
    topics = Topics(settings.topic_prefix)
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(),
        **kafka_client_options(),
        acks="all",
        linger_ms=20,
        batch_size=512 * 1024,
    )
    customers: list[str] = []
    books: list[tuple[str, int, str]] = []
    written = 0

    def send(agg: str, agg_id: str, version: int, event: Any) -> None:
        nonlocal written
        at = start + span * (written / events) if span else datetime.now(UTC)
        env = envelope_for(
            event,
            event_id=str(uuid.uuid4()),
            aggregate_type=agg,
            aggregate_id=agg_id,
            version=version,
            occurred_at=at.isoformat().replace("+00:00", "Z"),
            command_id="bench",
            correlation_id="bench",
            causation_id="bench",
        )
        producer.send(
            topics.events(agg),
            key=f"{agg_id}:{version}".encode(),
            value=encode(env),
            partition=partition_for(agg_id, settings.partitions),
            timestamp_ms=int(at.timestamp() * 1000) if span else None,
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
