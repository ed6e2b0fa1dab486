"""freshness: command `201` -> row visible, at several rates, beside a trivial query's ceiling (see
bench/read_side.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from kafka import KafkaProducer
from kafka.admin import NewTopic
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procstat import CpuMeter
from bench.read_stack import (
    CEILING_SQL,
    Stack,
    extra,
    open_loop,
    posting,
    read_your_write,
    settled,
    start_warmed,
    threaded,
    visible,
    warm_up,
    warmup,
)
from config.settings import Settings, kafka_client_options
from stack.procs import wait_until
from stack.topics import admin_client, wait_for_topics
from tests.support import Processes, token


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
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(), acks="all", **kafka_client_options()
    )
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

        warmed = [open_loop(settings, rate, warmup, threaded(send), CEILING_SQL)] if warmup else []
        runs = [
            open_loop(settings, rate, duration, threaded(send), CEILING_SQL) for _ in range(repeats)
        ]
        return {
            "p50_ms": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            "runs": runs,
            "warmup": warmed,
        }
    finally:
        query.stop()
        producer.close()
        spark.stop()
