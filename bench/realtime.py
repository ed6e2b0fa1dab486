"""What the live event pipeline would give in Spark's real-time mode: the measurement behind the
plan in `docs/design.md` ("Next: the live path in real-time mode"). Not the projector's code.

    .venv/bin/python bench/realtime.py --rates 50 200 --duration 20 --repeats 3

The whole write side runs as `bench/read_side.py freshness` runs it (processor, CDC, API, local
Kafka and Postgres, the same open-loop generator), but the projector is replaced by, in this
process:

- a Structured Streaming query in real-time mode (`trigger(realTime=...)`, Spark 4.1+): the
  event topics read with the projector's options, each record decoded and every output's rows
  computed by the projector's own plan (`EventSink.with_rows`), written to a `rows` topic
  keyed by the record's topic and partition (so one source partition's rows stay in order);
- a thread that reads that topic and applies what each poll returns with the projector's own
  Postgres step (`EventSink.apply`: one transaction, each projection from its own progress).

Real-time mode runs one long-lived task per Kafka partition, which hands each record on as it
arrives, instead of a micro-batch planned and run per trigger. Its sinks are Kafka, `foreach`
and the console: a Python `foreach` writer is not usable for this (the JVM hands it rows in
pickled runs of 1, 2, 4, ... in a 64 KiB buffer that is sent when full: seconds late), hence the
topic in between.

For each `201` of `register-customer` it times when the row is visible in `customers`, as
freshness does; then the CPU of the idle stack over 30 s. Output: JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from kafka import KafkaConsumer
from kafka.admin import NewTopic
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from bench.procstat import CpuMeter
from bench.read_side import Stack, open_loop, posting
from projections.registry import PROJECTIONS
from spark.decode import every_event, kafka_options, parse_events
from spark.event_pipeline import EventPipeline, EventSink
from spark.session import session
from spark.sink import ensure_progress, mark_started
from stack.procs import wait_until
from stack.settings import Settings
from stack.topics import Topics, admin_client
from tests.support import HttpApi, Processes, token

CUSTOMERS = "SELECT customer_id FROM customers WHERE customer_id = ANY(%s)"


class RowsApplier:
    """Reads the rows topic; applies each poll's records in one Postgres transaction."""

    def __init__(self, settings: Settings, sink: EventSink, topic: str, columns: list[str]):
        self.settings, self.sink, self.topic, self.columns = settings, sink, topic, columns
        self.stopping = threading.Event()
        self.transactions = self.records = 0
        self.thread = threading.Thread(target=self._run, name="rows", daemon=True)

    def _run(self) -> None:
        consumer = KafkaConsumer(
            self.topic,
            bootstrap_servers=self.settings.kafka(),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            metrics_enabled=False,
            max_poll_records=5000,
        )
        try:
            while not self.stopping.is_set():
                rows = []
                for records in consumer.poll(timeout_ms=500).values():
                    for r in records:
                        row = json.loads(r.value)
                        rows.append([row.get(c) for c in self.columns])
                if rows:
                    self.transactions += 1
                    self.records += len(rows)
                    self.sink.apply(rows, {})
        finally:
            consumer.close()


def start(
    spark: SparkSession, settings: Settings, scratch: str
) -> tuple[StreamingQuery, RowsApplier]:
    projections = list(PROJECTIONS.values())
    pipeline = EventPipeline(spark, settings, projections, scratch)
    sink = EventSink(projections, settings)
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        for p in projections:
            ensure_progress(conn, p.name)
        mark_started(conn, [p.name for p in projections])
    topic = f"{settings.topic_prefix}rows"
    admin = admin_client(settings)
    try:
        admin.create_topics([NewTopic(topic, settings.partitions, 1)])
    finally:
        admin.close()
    records = (
        spark.readStream.format("kafka")
        .options(**kafka_options(settings.kafka()))
        # A long-lived task's fetch returns as soon as a record arrives; 0 would spin.
        .option("kafka.fetch.max.wait.ms", "500")
        .option("subscribe", ",".join(pipeline.topic_names()))
        .option("startingOffsets", pipeline.starting_offsets())
        .load()
    )
    rows: DataFrame = sink.with_rows(every_event(parse_events(records, pipeline.stream_names())))
    columns = rows.columns
    query = (
        rows.select(
            F.concat_ws(":", "topic", F.col("partition").cast("string")).alias("key"),
            F.to_json(F.struct(*[F.col(f"`{c}`") for c in columns])).alias("value"),
        )
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", settings.kafka())
        .option("kafka.linger.ms", "0")
        .option("topic", topic)
        .option("checkpointLocation", tempfile.mkdtemp(dir=scratch))
        .outputMode("update")
        # The interval is how often progress is checkpointed, not a latency (5 s at least).
        .trigger(realTime="5 minutes")
        .start()
    )
    applier = RowsApplier(settings, sink, topic, columns)
    applier.thread.start()
    return query, applier


def run(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(args.partitions)
    with stack as base:
        # One task slot per partition the query reads (held for good), and two for the rest.
        topics = Topics(base.topic_prefix)
        slots = len({t for p in PROJECTIONS.values() for t in p.topic_names(topics)})
        settings = base.model_copy(update={"spark_master": f"local[{slots * args.partitions + 2}]"})
        procs = Processes(settings, stack.work)
        spark = session(settings, "logfold-realtime-bench", settings.projector_java_options)
        scratch = tempfile.mkdtemp(dir=stack.work)
        query, applier = start(spark, settings, scratch)
        try:
            roots = {"processor": procs.processor().pid, "cdc": procs.cdc().pid}
            api_proc, url = procs.api()
            jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
            roots |= stack.infrastructure() | {"api": api_proc.pid, "spark": jvm}
            roots["bench"] = os.getpid()  # the rows thread, the generator and the monitor
            meter = CpuMeter(roots, alone=("bench",))
            procs.wait_processing(url, 1)
            api = HttpApi(url, token())
            first = api.command("register-customer", {"name": "w", "email": "w@example.com"})
            wait_until(
                lambda: _visible(settings, first.body["aggregate_id"]), 120, "the first customer"
            )

            def command(_: int) -> tuple[str, dict[str, str]]:
                return "register-customer", {"name": "n", "email": "n@example.com"}

            levels = []
            for rate in args.rates:
                drive = posting(url, command)
                warm = open_loop(settings, rate, args.warmup, drive, CUSTOMERS, meter)
                runs = [
                    open_loop(settings, rate, args.duration, drive, CUSTOMERS, meter)
                    for _ in range(args.repeats)
                ]
                levels.append(
                    {
                        "offered_per_s": rate,
                        "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                        "runs": runs,
                        "warmup": warm,
                    }
                )
                print(
                    f"{rate:g}/s: p50 {levels[-1]['p50_ms']:.1f} ms, "
                    f"p99 {levels[-1]['p99_ms']:.1f} ms",
                    file=sys.stderr,
                )
            time.sleep(20)  # the last commands applied, the JVMs settled
            meter.start()
            time.sleep(30)
            return {
                "benchmark": "realtime",
                "spark": spark.version,
                "customers": levels,
                "idle_cpu_pct": {k: round(v, 1) for k, v in meter.stop().items()},
                "transactions": applier.transactions,
                "records": applier.records,
            }
        finally:
            applier.stopping.set()
            query.stop()
            spark.stop()
            procs.stop()


def _visible(settings: Settings, key: str) -> bool:
    with psycopg.connect(settings.database()) as conn:
        return conn.execute(CUSTOMERS, ([key],)).fetchone() is not None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 200])
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=20, help="seconds per rate, not counted")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic")
    print(json.dumps(run(parser.parse_args()), indent=1, default=str))


if __name__ == "__main__":
    main()
