"""batch and stages: what one event-pipeline batch costs in Spark, and where a live batch goes (see
bench/read_side.py)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.read_stack import Stack, write_log
from config.topics import Topics


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
        spark = spark_session.session(settings, "logfold-bench", settings.projector_jvm_options())
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
