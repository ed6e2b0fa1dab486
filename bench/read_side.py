"""Read-side benchmarks on the full local stack (real Kafka, Postgres, Spark).

    .venv/bin/python bench/read_side.py freshness --rates 10 50 200 --duration 20 --repeats 3
    .venv/bin/python bench/read_side.py rebuild --events 1000000 --repeats 3
    .venv/bin/python bench/read_side.py rebuild-workers --events 300000 --repeats 2
    .venv/bin/python bench/read_side.py spark-start --repeats 5
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

rebuild: writes N events of a realistic bookshop mix straight into the event topics, times
`logfold rebuild --all` as a user runs it (a new process, from the command to its exit): first
with no projector running (the command starts a Spark driver of its own), then handed to a
projector started for it (its first rebuild after the start, then the next); then times the
rebuild of every projection (one read of the log for all, as `rebuild --all`); in the same run,
the bare rate of reading the same records from Kafka with Spark (no decoding), of reading and
decoding them as the rebuild does (nothing kept: Spark's `noop` sink), and of COPYing rows
of the views' width into Postgres, as ceilings.

rebuild-workers: the same rebuild on a Spark standalone cluster started here (as the cluster
topology starts it), with 1 worker and with 2, each declaring --cores slots, alternating, a new
cluster each time (its first rebuild warms the executors and is not counted): how the rebuild
scales with executors, as far as one machine shows it (the driver, Kafka and Postgres share it).

spark-start: a Spark driver's start (a session and its first query, each in a new process, as
a projector or a rebuild starts) with the class archive `make bootstrap` makes
(spark/class_archive.py) against without it, alternating; no stack needed.

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.read_api import first_reads, through_the_api
from bench.read_batch import STAGE_VARIANTS, batch_cost, stages
from bench.read_freshness import freshness
from bench.read_idle import idle
from bench.read_rebuild import rebuild, rebuild_jvms, rebuild_workers, spark_start


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
    r.add_argument(
        "--projector-repeats",
        type=int,
        default=2,
        help="times `logfold rebuild --all` is handed to a running projector (0: not measured)",
    )
    r.add_argument(
        "--days",
        type=float,
        default=0,
        help="the events occur evenly over this many days up to now (default: as written)",
    )
    rw = sub.add_parser(
        "rebuild-workers", help="the rebuild on a Spark standalone cluster, 1 worker against 2"
    )
    rw.add_argument("--events", type=int, default=300_000)
    rw.add_argument("--repeats", type=int, default=2, help="rounds, each worker count once")
    rw.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    rw.add_argument("--cores", type=int, default=1, help="slots each worker declares")
    rw.add_argument("--executor-memory", default="2g")
    rj = sub.add_parser(
        "rebuild-jvms",
        help="the cold `logfold rebuild --all` on this JVM against another's (JDK 25+) AOT cache",
    )
    rj.add_argument("--events", type=int, default=1_000_000)
    rj.add_argument("--repeats", type=int, default=3, help="rounds, each kind once")
    rj.add_argument(
        "--java-home",
        required=True,
        help="the other JDK (25 or later: its ahead-of-time cache), e.g. /usr/lib/jvm/jdk-25",
    )
    ss = sub.add_parser(
        "spark-start", help="a Spark driver's start with the class archive against without"
    )
    ss.add_argument("--repeats", type=int, default=5, help="starts of each, alternating")
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
        "rebuild-workers": rebuild_workers,
        "rebuild-jvms": rebuild_jvms,
        "spark-start": spark_start,
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
