"""rebuild: replaying a large log into every projection, beside its ceilings (see
bench/read_side.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.archives import with_and_without
from bench.read_stack import Stack, write_log
from config.jvm import java
from config.settings import Settings
from config.topics import Topics
from tests.support import child_env

ROOT = Path(__file__).resolve().parents[1]
# What a user types to rebuild every view in a driver of its own (`--here`: not handed to a
# running projector).
REBUILD = ("rebuild", "--all", "--here")
# What a projector logs once its rebuild rehearsal has ended (spark/rebuilder.py).
REHEARSED = re.compile(r"rebuild rehearsed: [^\"\n]*|rebuild rehearsal failed[^\"\n]*")


def rebuild(args: argparse.Namespace) -> dict[str, Any]:
    from projections.registry import PROJECTIONS
    from spark.decode import every_event, parse_events, read_batch
    from spark.rebuild import Rebuild
    from spark.session import session

    with Stack() as settings:
        written = write_log(settings, args.events, span=timedelta(days=args.days))
        results: dict[str, Any] = {
            "benchmark": "rebuild",
            "events_in_log": written,
            "log_span_days": args.days,
        }
        # First as a user runs it: `logfold rebuild --all` in a new process, from the command
        # to its exit: with no projector running (a driver of its own, its JVM cold), then
        # handed to a running projector (its driver warm); then the warm figures, in this
        # process.
        env = {k: v for k, v in os.environ.items() if k.startswith("LOGFOLD_")}
        env |= child_env(settings)  # the bench's settings (driver memory...), its stack
        t = time.perf_counter()
        out = _command(env, *REBUILD)
        results["cold_command_seconds"] = time.perf_counter() - t
        results["cold_command_output"] = out.stdout.splitlines()
        if args.projector_repeats:
            results |= _handed_to_the_projector(settings, env, args.projector_repeats)
        spark = session(settings, "logfold-bench")
        job = Rebuild(settings, spark)
        topics = Topics(settings.topic_prefix)
        everything = [topics.events(a) for a in ("customer", "book", "order")]
        log = read_batch(spark, settings.kafka(), everything, "earliest", "latest")
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
        medians = {
            k: statistics.median(v)
            for k, v in results.items()
            if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
        }
        return {**results, "medians": medians}


def _command(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`logfold <args>` run to its end; exits the bench if it failed."""
    out = subprocess.run(
        [sys.executable, "-m", "stack.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise SystemExit(f"logfold {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out


def _handed_to_the_projector(
    settings: Settings, env: dict[str, str], repeats: int
) -> dict[str, Any]:
    """`logfold rebuild --all` with a projector running (started here, its views already
    current): the command hands the rebuild to it; its first rebuild after the projector's
    start (and, when the projector rehearses a rebuild, after that rehearsal has ended, as a
    rebuild asked a minute or more after a start is), then the next ones."""
    said = Path(tempfile.mkdtemp(prefix="logfold-bench-projector-")) / "projector.log"
    rehearsing = env.get("LOGFOLD_PROJECTOR_REBUILD_REHEARSAL_RECORDS", "1") != "0"
    with said.open("w") as out_file:
        projector = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "projector"],
            cwd=ROOT,
            env={**env, "LOGFOLD_LOG_LEVEL": "INFO"},  # its rehearsal's end is an INFO line
            stdout=subprocess.DEVNULL,
            stderr=out_file,
        )
    try:
        t = time.perf_counter()
        deadline = time.monotonic() + 600
        while not _projector_running(settings):
            if projector.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the projector did not start (its output: {said})")
            time.sleep(0.5)
        found: dict[str, Any] = {"projector_start_seconds": time.perf_counter() - t}
        if rehearsing:
            ended = None
            while ended is None:
                ended = REHEARSED.search(said.read_text())
                if projector.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the projector's rehearsal did not end (its output: {said})")
                time.sleep(0.5)
            found["projector_rehearsal"] = ended[0]
            found["projector_rehearsal_ended_seconds"] = time.perf_counter() - t
        for _ in range(repeats):
            t = time.perf_counter()
            out = _command(env, "rebuild", "--all")
            found.setdefault("projector_command_seconds", []).append(time.perf_counter() - t)
            if "is rebuilding" not in out.stderr:
                raise SystemExit(f"the projector did not take the rebuild:\n{out.stderr}")
            # Each run's lines: what the first spends beyond the next ones, by projection.
            found.setdefault("projector_command_output", []).append(out.stdout.splitlines())
        return found
    finally:
        projector.terminate()
        projector.wait(timeout=120)


def rebuild_jvms(args: argparse.Namespace) -> dict[str, Any]:
    """`logfold rebuild --all --here` as a user types it (a new process, its JVM cold), on one
    log, on this machine's JVM with its class archive against another JVM (`--java-home`, JDK
    25 or later) three ways: with no archive; with an ahead-of-time cache made from the class
    archive's small workload (what `make bootstrap` could make); with one its own first rebuild
    of this log trained (the best such a cache can do). Alternating, a round at a time."""
    other = Path(args.java_home)
    caches = Path(tempfile.mkdtemp(prefix="logfold-bench-aot-"))
    small, trained = caches / "small.aot", caches / "trained.aot"
    try:
        with Stack() as settings:
            written = write_log(settings, args.events)
            env = {k: v for k, v in os.environ.items() if k.startswith("LOGFOLD_")}
            env |= child_env(settings)
            on_other = env | {"JAVA_HOME": str(other)}
            subprocess.run(
                [sys.executable, "-m", "stack.class_archive", "--write-aot-cache", str(small)],
                cwd=ROOT,
                env=on_other,
                capture_output=True,
                check=True,
                timeout=600,
            )
            # The training run: its JVM writes the cache as it exits (a child JVM assembles it).
            _command(on_other | {"SPARK_SUBMIT_OPTS": f"-XX:AOTCacheOutput={trained}"}, *REBUILD)
            kinds = {
                "default JVM, its class archive": env,
                "other JVM, no archive": on_other,
                "other JVM, AOT cache of the small workload": on_other
                | {"SPARK_SUBMIT_OPTS": f"-XX:AOTCache={small}"},
                "other JVM, AOT cache trained on this rebuild": on_other
                | {"SPARK_SUBMIT_OPTS": f"-XX:AOTCache={trained}"},
            }
            runs: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.repeats):
                for kind, kind_env in kinds.items():
                    t = time.perf_counter()
                    _command(kind_env, *REBUILD)
                    runs[kind].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    medians = {kind: statistics.median(v) for kind, v in runs.items()}
    default = medians["default JVM, its class archive"]
    return {
        "benchmark": "rebuild-jvms",
        "events_in_log": written,
        "default_java": java(),
        "other_java_home": str(other),
        "cold_command_seconds": runs,
        "medians": medians,
        "ratio_to_default": {kind: m / default for kind, m in medians.items()},
    }


def _projector_running(settings: Settings) -> bool:
    """The projector beats and both its queries are active."""
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute("SELECT queries FROM projector_status").fetchone()
    return row is not None and all(q.get("active") for q in row[0].values())


def rebuild_workers(args: argparse.Namespace) -> dict[str, Any]:
    """The rebuild on a Spark standalone cluster (the cluster topology's), with 1 worker and
    with 2 (each declaring `--cores` slots), alternating, each round on a new cluster: how the
    rebuild scales with executors, as far as one machine shows it. Each cluster's first
    rebuild warms its executors' JVMs and is not counted."""
    from projections.registry import PROJECTIONS
    from spark.decode import every_event, parse_events, read_batch
    from spark.rebuild import Rebuild
    from spark.session import session
    from stack.local_spark import SparkStandalone

    stack = Stack()
    with stack as settings:
        written = write_log(settings, args.events)
        topics = Topics(settings.topic_prefix)
        everything = [topics.events(a) for a in ("customer", "book", "order")]
        runs: list[dict[str, Any]] = []
        for round_ in range(args.repeats):
            for workers in args.workers:
                cluster = SparkStandalone(
                    stack.work / f"spark-{round_}-{workers}",
                    workers=workers,
                    cores=args.cores,
                    memory=args.executor_memory,
                )
                cluster.start()
                try:
                    on = settings.model_copy(update={"spark_master": cluster.url})
                    spark = session(on, "logfold-bench-workers")
                    job = Rebuild(on, spark)
                    projections = list(PROJECTIONS.values())
                    job.run_many(projections, verify=False, progress=False)  # warms the JVMs
                    t = time.perf_counter()
                    reports = job.run_many(projections, verify=False, progress=False)
                    took = time.perf_counter() - t
                    log = read_batch(spark, on.kafka(), everything, "earliest", "latest")
                    t = time.perf_counter()
                    every_event(parse_events(log)).write.format("noop").mode("overwrite").save()
                    decode = time.perf_counter() - t
                    runs.append(
                        {
                            "workers": workers,
                            "slots": workers * args.cores,
                            "all_views_seconds": round(took, 2),
                            "all_views_events_per_s": round(written / took),
                            "read_seconds": round(reports[0].steps["read"], 2),
                            "spark_read_and_decode_per_s": round(written / decode),
                        }
                    )
                    print(runs[-1], file=sys.stderr)
                    spark.stop()
                finally:
                    cluster.stop()
        by = {
            w: {
                k: statistics.median(r[k] for r in runs if r["workers"] == w)
                for k in ("all_views_events_per_s", "spark_read_and_decode_per_s")
            }
            for w in args.workers
        }
        lo, hi = min(args.workers), max(args.workers)
        return {
            "benchmark": "rebuild-workers",
            "topology": f"rebuild alone on a Spark standalone master with {args.workers} "
            f"workers of {args.cores} slot(s) each; Kafka, Postgres, the driver on one machine",
            "events_in_log": written,
            "medians": by,
            "speedup": {k: round(by[hi][k] / by[lo][k], 2) for k in by[lo]},
            "runs": runs,
        }


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


# One Spark start, in a new process: a session and its first query, as a projector or a rebuild
# starts (timed in that process, without the interpreter's own start).
_START = """
import json, time
t0 = time.perf_counter()
from config.settings import Settings
from spark.session import session
spark = session(Settings(), "logfold-bench-start")
t1 = time.perf_counter()
spark.range(1000).selectExpr("id * 2 AS x").groupBy().sum("x").collect()
t2 = time.perf_counter()
print(json.dumps({"session_s": t1 - t0, "first_query_s": t2 - t1, "total_s": t2 - t0}))
"""


def spark_start(args: argparse.Namespace) -> dict[str, Any]:
    """A Spark driver's start with the class archive (spark/class_archive.py) against without,
    alternating, each in a new process; medians and their ratio."""
    from stack import class_archive

    archive = class_archive.ensure(Settings())
    runs: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    root = Path(__file__).resolve().parents[1]
    for _ in range(args.repeats):
        for mode, on in (("with", "true"), ("without", "false")):
            env = {**os.environ, "LOGFOLD_SPARK_CLASS_ARCHIVE": on}
            out = subprocess.run(
                [sys.executable, "-c", _START],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return with_and_without("spark-start", archive, runs)
