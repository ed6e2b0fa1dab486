"""Write-side benchmarks on the full local stack (real Kafka broker, `logfold processor` and
`logfold api` processes, local Postgres).

    .venv/bin/python bench/commands.py load --rates 50 200 500 800 1000 --duration 15 --repeats 3
    .venv/bin/python bench/commands.py profile --rate 500 --duration 20
    .venv/bin/python bench/commands.py compare --duration 15 --repeats 3
    .venv/bin/python bench/commands.py aggregate --events 10000 --repeats 3
    .venv/bin/python bench/commands.py transactions --rounds 8
    .venv/bin/python bench/commands.py broker-start --repeats 5

load: sustained commands/s and latency at several offered loads (`rename-customer` on 200
customers in turn), and, in the same run, the raw kafka-python transactional produce rate of
records of an event's size (the ceiling), and what `compare` measures. Load is open-loop
(bench/loadgen.py): requests are scheduled at a fixed rate and latency is measured from the
scheduled send time.

profile: the same load at one rate while py-spy samples every API and processor process; the
CPU each command costs, by stage, and per process (the broker and the load generator by
/proc), with the records and bytes each command writes and the commands per transaction.

compare: the closed loops of `load` (1 and 4 clients, and a 3,000-event aggregate) against the
`eventsourcing` library doing the same on the same Postgres, and the produce ceiling.

aggregate: the latency of commands on an aggregate with N events against a fresh one's, side by
side (closed loop, one client at a time).

transactions: a transaction shaped as the processor's for one command (a record each to an
event, a snapshot, a reply and an offset topic) on a broker of its own, paced (a pause of
1/--rate s after each, as commands arriving apart) and back to back, in rounds: the CPU it
costs the producer (kafka-python, whichever version is installed) and the broker, and the
broker's JIT compiler's share, round by round.

broker-start: a Kafka broker's start, from its launch until it answers as a broker, each a new
process on a new data directory, with the class archive `make bootstrap` made (stack/
class_archive.py) against without, alternating: the time and the broker's CPU by then; medians
and their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen, pyspy
from bench.archives import with_and_without
from bench.procstat import CpuMeter, cpu_seconds, jit_seconds
from config.settings import Settings, kafka_client_options
from config.topics import Topics
from events.customer import CustomerRenamed
from events.serialization import encode, envelope_for
from events.store import committed_reader
from stack.local_kafka import LocalKafka
from stack.local_postgres import LocalPostgres
from stack.migrate import upgrade
from stack.procs import free_port
from stack.topics import create_topics, topic_specs, wait_for_topics
from tests.support import SECRET, HttpApi, Processes, token


@dataclass
class WriteStack:
    work: Path
    database_url: str
    kafka: LocalKafka
    settings: Settings
    procs: Processes
    urls: list[str]
    customers: list[str]


@contextlib.contextmanager
def write_stack(
    processors: int,
    apis: int,
    customers: int,
    env: dict[str, str] | None = None,
    broker_config: tuple[str, ...] = (),
) -> Iterator[WriteStack]:
    """Kafka, Postgres, `processors` processors and `apis` API processes, with `customers`
    registered customers; everything stopped on exit."""
    work = Path(tempfile.mkdtemp(prefix="logfold-bench-"))
    work.chmod(0o755)
    kafka = LocalKafka(Path(".stack/lib"), work / "kafka", free_port(), free_port(), broker_config)
    pg = LocalPostgres(work / "pg", free_port())
    kafka.start()
    pg.start()
    upgrade(pg.url)  # the processors keep their data subjects' keys in Postgres
    settings = Settings(
        kafka_bootstrap_servers=kafka.bootstrap,
        database_url=pg.url,
        jwt_secret=SECRET,
        topic_prefix="bench.",
        partitions=4,
    )
    create_topics(settings)
    procs = Processes(settings, work, env)
    try:
        for _ in range(processors):
            procs.processor()
        urls = [procs.api()[1] for _ in range(apis)]
        procs.wait_processing(urls[0], processors)
        client = HttpApi(urls[0], token())
        ids = [
            client.command(
                "register-customer", {"name": f"c{i}", "email": f"c{i}@example.com"}
            ).body["aggregate_id"]
            for i in tqdm(range(customers), desc="creating customers", unit="cmd")
        ]
        yield WriteStack(work, pg.url, kafka, settings, procs, urls, ids)
    finally:
        procs.stop()
        pg.stop()
        kafka.stop()


def offered(stack: WriteStack, rate: float, duration: float) -> loadgen.Result:
    return loadgen.offered_load(
        stack.urls, token(), loadgen.renames(stack.customers), rate, duration
    )


def warm_up(stack: WriteStack, seconds: float) -> None:
    """Load until the JVM's optimising compiler is done with the broker's hot code: without
    it, the first half minute of load measured the broker's C2 compiler threads (half a core)
    more than the system."""
    for rate in tqdm((100, 300, 500), desc=f"warming up ({seconds:.0f} s)", unit="level"):
        offered(stack, rate, seconds / 3)


def raw_produce(bootstrap: str, topic: str, record: bytes, seconds: float, per_txn: int) -> float:
    """Records/s of a transactional kafka-python producer, `per_txn` records per transaction."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        **kafka_client_options(),
        transactional_id=f"bench-{uuid.uuid4()}",
        acks="all",
        enable_idempotence=True,
        linger_ms=1,
        retry_backoff_ms=10,
    )
    producer.init_transactions()
    sent, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        producer.begin_transaction()
        for _ in range(per_txn):
            producer.send(topic, key=b"k", value=record, partition=0)
        producer.commit_transaction()
        sent += per_txn
    rate = sent / (time.perf_counter() - start)
    producer.close()
    return rate


def an_event() -> bytes:
    return encode(
        envelope_for(
            CustomerRenamed(name="n123"),
            event_id=str(uuid.uuid4()),
            aggregate_type="customer",
            aggregate_id=str(uuid.uuid4()),
            version=7,
            occurred_at="2026-01-01T00:00:00Z",
            command_id=str(uuid.uuid4()),
            correlation_id=str(uuid.uuid4()),
            causation_id=str(uuid.uuid4()),
        )
    )


def roles(stack: WriteStack) -> dict[str, int]:
    """Process name -> pid: `api-<i>`, `processor-<i>`, `broker`."""
    assert stack.kafka.proc is not None
    found = {
        f"{'api' if 'api' in str(p.args) else 'processor'}-{i}": p.pid
        for i, p in enumerate(stack.procs.procs)
    }
    return {**found, "broker": stack.kafka.proc.pid}


def ms_per_command(
    cpu: dict[str, float], names: list[str], result: loadgen.Result
) -> dict[str, float]:
    """CPU ms each named process spent per accepted command (from a CpuMeter's figures)."""
    commands = max(result.statuses.get(201, 0), 1)
    return {n: cpu[f"{n}_pct"] / 100 * float(cpu["wall_s"]) * 1e3 / commands for n in names}


def measured(
    stack: WriteStack, rate: float, duration: float
) -> tuple[loadgen.Result, dict[str, float]]:
    """One run, with the CPU each kind of process spent per command (ms)."""
    meter = CpuMeter({**roles(stack), "load_generator": os.getpid()}, alone=("load_generator",))
    meter.start()
    result = offered(stack, rate, duration)
    cpu = meter.stop()
    per_kind: dict[str, float] = {}
    for name, ms in ms_per_command(cpu, [*roles(stack), "load_generator"], result).items():
        kind = name.split("-")[0]
        per_kind[kind] = per_kind.get(kind, 0.0) + ms
    per_kind["total"] = sum(per_kind.values())
    per_kind["machine_busy_pct"] = cpu["machine_busy_pct"]
    return result, per_kind


def closed_loop(stack: WriteStack, ids: list[str], clients: int, seconds: float) -> float:
    """Renames/s by `clients` clients renaming customers as fast as they can, each going round
    its own share of `ids`, with the expected version read from the previous reply: what
    `bench/library.py` does with the library, over HTTP."""
    apis = [HttpApi(stack.urls[c % len(stack.urls)], token()) for c in range(clients)]
    versions: dict[str, int | None] = dict.fromkeys(ids)
    next_for = loadgen.rounds(ids, clients)

    def rename(c: int) -> None:
        customer = next_for(c)
        answer = apis[c].command(
            "rename-customer", {"name": "n"}, customer, expected_version=versions[customer]
        )
        assert answer.status == 201, answer
        versions[customer] = answer.body["version"]

    return loadgen.closed_loop(clients, seconds, rename)


def grow(stack: WriteStack, events: int, rate: float = 400) -> str:
    """A customer with `events` events (renamed at `rate`/s, no expected version)."""
    api = HttpApi(stack.urls[0], token())
    customer = str(
        api.command("register-customer", {"name": "x", "email": "x@example.com"}).body[
            "aggregate_id"
        ]
    )
    print(f"growing a customer to {events} events…", file=sys.stderr)
    result = loadgen.offered_load(
        stack.urls, token(), loadgen.renames([customer]), rate, (events - 1) / rate
    )
    assert result.statuses == {201: events - 1}, result.statuses
    return customer


def side_by_side(stack: WriteStack, args: argparse.Namespace) -> dict[str, Any]:
    """Logfold closed loop (1 and 4 clients, fresh customers and a long one) and the
    `eventsourcing` library doing the same on the same Postgres, with the ratios."""
    from bench import library

    long_id = grow(stack, args.long_events)
    ours = {
        "1_thread_per_s": statistics.median(
            closed_loop(stack, stack.customers, 1, args.duration) for _ in range(args.repeats)
        ),
        "4_thread_per_s": statistics.median(
            closed_loop(stack, stack.customers, 4, args.duration) for _ in range(args.repeats)
        ),
        f"{args.long_events}_event_aggregate_per_s": statistics.median(
            closed_loop(stack, [long_id], 1, args.duration) for _ in range(args.repeats)
        ),
    }
    theirs = library.measure(
        stack.database_url, args.repeats, args.duration, args.long_events, len(stack.customers)
    )
    return {
        "logfold": ours,
        "eventsourcing_library": theirs,
        "ratio_logfold_to_library": {
            k: ours[k.removesuffix("_async_commit")] / v for k, v in theirs.items()
        },
    }


def ceilings(stack: WriteStack, repeats: int) -> dict[str, float]:
    """Records/s of a bare transactional producer, 1 and 100 records per transaction, into a
    topic of its own configured like an event topic (writing into an event topic would move
    the offsets the processor announces, and restart it)."""
    record = an_event()
    topic = "bench.ceiling"
    admin = KafkaAdminClient(bootstrap_servers=stack.kafka.bootstrap, **kafka_client_options())
    try:
        if topic not in admin.list_topics():
            spec = topic_specs(Topics(stack.settings.topic_prefix))[0]  # an event topic
            admin.create_topics([NewTopic(topic, 1, 1, topic_configs=spec.configs)])
            wait_for_topics(admin, [topic], timeout_s=30.0)
    finally:
        admin.close()
    return {
        f"raw_txn_produce_{n}_per_txn": statistics.median(
            raw_produce(stack.kafka.bootstrap, topic, record, 5, n) for _ in range(repeats)
        )
        for n in (1, 100)
    }


def compare(args: argparse.Namespace) -> dict[str, object]:
    """The closed loops of `load` against the library, and the produce ceiling, alone."""
    with write_stack(
        args.processors, args.apis, args.aggregates, args.env, tuple(args.broker_config)
    ) as stack:
        warm_up(stack, args.warmup)
        return {
            "ceilings_records_per_s": ceilings(stack, args.repeats),
            "library": side_by_side(stack, args),
        }


def load(args: argparse.Namespace) -> dict[str, object]:
    with write_stack(
        args.processors, args.apis, args.aggregates, args.env, tuple(args.broker_config)
    ) as stack:
        warm_up(stack, args.warmup)
        levels: list[dict[str, Any]] = []
        for rate in tqdm(args.rates, desc="load levels", unit="level"):
            runs = [measured(stack, rate, args.duration) for _ in range(args.repeats)]
            levels.append(
                {
                    "offered_per_s": rate,
                    "completed_per_s": statistics.median(r.completed_per_s for r, _ in runs),
                    "p50_ms": statistics.median(r.ms(0.5) for r, _ in runs),
                    "p99_ms": statistics.median(r.ms(0.99) for r, _ in runs),
                    "runs_p50_p99_ms": [[r.ms(0.5), r.ms(0.99)] for r, _ in runs],
                    "statuses": [r.statuses for r, _ in runs],
                    "cpu_ms_per_command": {
                        k: round(statistics.median(c[k] for _, c in runs), 3) for k in runs[0][1]
                    },
                }
            )
        raw = ceilings(stack, args.repeats)
        library = side_by_side(stack, args) if args.library else None
    best = max(float(level["completed_per_s"]) for level in levels)
    return {
        "record_bytes": len(an_event()),
        "levels": levels,
        "ceilings_records_per_s": raw,
        "library": library,
        "ratio_sustained_to_library": (
            {
                k: best / v
                for k, v in library["eventsourcing_library"].items()
                if k.endswith("thread_per_s")
            }
            if library
            else None
        ),
        "processors": args.processors,
        "apis": args.apis,
    }


# Where a sampled stack's CPU goes, by the first text it contains (see bench/pyspy.py).
API_STAGES: pyspy.Rules = [
    ("_read_replies (commands/bus.py", "reply routing"),
    ("_send (commands/bus.py", "producing the command"),
    ("producer/sender.py", "producing the command"),
    ("health.py", "health monitor"),
]
PROCESSOR_STAGES: pyspy.Rules = [
    ("decode (commands/messages.py", "consuming"),
    ("handle (commands/handling.py", "deciding"),
    ("process (commands/processor.py", "transaction"),
    ("producer/sender.py", "transaction"),
    ("_claim (commands/processor.py", "restoring partitions"),
    ("(commands/processor.py", "consuming"),  # the poll loop, the snapshot replica
]


def _topic_counts(bootstrap: str, topics: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per topic: (end offset sum, committed records, committed bytes) — offsets minus records
    are transaction markers."""
    consumer = committed_reader(bootstrap, fetch_max_wait_ms=10)
    counts = {}
    try:
        for topic in topics:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            end = consumer.end_offsets(tps)
            records = size = 0
            while any(consumer.position(tp) < end[tp] for tp in tps):
                for batch in consumer.poll(timeout_ms=200).values():
                    records += len(batch)
                    size += sum(len(r.value or b"") + len(r.key or b"") for r in batch)
            counts[topic] = (sum(end.values()), records, size)
    finally:
        consumer.close()
    return counts


def profile(args: argparse.Namespace) -> dict[str, object]:
    with write_stack(
        args.processors, args.apis, args.aggregates, args.env, tuple(args.broker_config)
    ) as stack:
        warm_up(stack, args.warmup)
        topics = Topics(stack.settings.topic_prefix)
        written = [topics.events("customer"), topics.snapshots, topics.replies, topics.commands]
        before = _topic_counts(stack.kafka.bootstrap, written)
        pids = roles(stack)
        meter = CpuMeter({**pids, "load_generator": os.getpid()}, alone=("load_generator",))
        recordings = {
            name: pyspy.Recording(pid, stack.work / f"{name}.raw", args.sample_rate)
            for name, pid in pids.items()
            if name != "broker"
        }
        meter.start()
        result = offered(stack, args.rate, args.duration)
        cpu = meter.stop()
        stacks = {name: rec.stop() for name, rec in recordings.items()}
        after = _topic_counts(stack.kafka.bootstrap, written)
    commands = max(result.statuses.get(201, 0), 1)
    # CPU per command, from /proc: what the samples are scaled to
    process_ms = ms_per_command(cpu, [*pids, "load_generator"], result)
    by_stage: dict[str, float] = {}
    for name, found in stacks.items():
        rules, default = (
            (API_STAGES, "HTTP and validation")
            if name.startswith("api")
            else (PROCESSOR_STAGES, "consuming")
        )
        split = pyspy.stages(found, rules, default)
        total = sum(split.values()) or 1
        for stage, samples in split.items():
            key = f"{name.split('-')[0]}: {stage}"
            by_stage[key] = by_stage.get(key, 0.0) + process_ms[name] * samples / total
    events_topic = topics.events("customer")
    writes = {}
    for topic in written:
        offsets = after[topic][0] - before[topic][0]
        records = after[topic][1] - before[topic][1]
        writes[topic] = {
            "records_per_command": records / commands,
            "bytes_per_command": (after[topic][2] - before[topic][2]) / commands,
            "markers": offsets - records,
        }
    transactions = writes[events_topic]["markers"]
    return {
        "load": result.summary(),
        # Each process's CPU (/proc) split by where its GIL-holding samples were.
        "cpu_ms_per_command_by_stage": {
            k: round(v, 3) for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1])
        },
        "cpu_ms_per_command_by_process": {k: round(v, 3) for k, v in process_ms.items()},
        "cpu_ms_per_command_total": round(sum(process_ms.values()), 3),
        "machine_busy_pct": cpu["machine_busy_pct"],
        "writes_per_command": writes,
        "commands_per_transaction": commands / max(transactions, 1),
        "hottest_functions": {
            name: [(f, round(n * 1e3 / args.sample_rate / commands, 3)) for f, n in top]
            for name, found in stacks.items()
            for top in [pyspy.top(found, 12)]
        },
    }


def aggregate(args: argparse.Namespace) -> dict[str, object]:
    """Closed-loop latency on a fresh aggregate and on one with `events` events, interleaved."""
    with write_stack(1, 1, 0) as stack:
        client = HttpApi(stack.urls[0], token())

        def register() -> str:
            return str(
                client.command("register-customer", {"name": "x", "email": "x@example.com"}).body[
                    "aggregate_id"
                ]
            )

        long_id = grow(stack, args.events)

        def timed(aggregate_id: str) -> float:
            t = time.perf_counter()
            answer = client.command("rename-customer", {"name": "y"}, aggregate_id=aggregate_id)
            assert answer.status == 201, answer
            return time.perf_counter() - t

        runs = []
        for _ in tqdm(range(args.repeats), desc="runs"):
            fresh, long = [], []
            for _ in range(args.commands):
                fresh.append(timed(register()))  # each fresh aggregate: 1 event, then this one
                long.append(timed(long_id))
            runs.append((statistics.median(fresh), statistics.median(long)))
    fresh_ms = statistics.median(r[0] for r in runs) * 1e3
    long_ms = statistics.median(r[1] for r in runs) * 1e3
    return {
        "events": args.events,
        "fresh_p50_ms": fresh_ms,
        "long_p50_ms": long_ms,
        "ratio": long_ms / fresh_ms,
        "runs_ms": [[a * 1e3, b * 1e3] for a, b in runs],
    }


class Merge(argparse.Action):
    """Repeated `--set K=V`: one dict."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), **values})


def transactions(args: argparse.Namespace) -> dict[str, object]:
    import kafka

    work = Path(tempfile.mkdtemp(prefix="logfold-bench-"))
    broker = LocalKafka(Path(".stack/lib"), work / "kafka", free_port(), free_port())
    broker.start()
    topics = ("event", "snapshot", "reply", "offset")
    try:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, **kafka_client_options())
        admin.create_topics([NewTopic(t, 4, 1) for t in topics])
        admin.close()
        producer = KafkaProducer(
            bootstrap_servers=broker.bootstrap,
            **kafka_client_options(),
            transactional_id=f"bench-{uuid.uuid4()}",
            acks="all",
            enable_idempotence=True,
            linger_ms=1,
            retry_backoff_ms=10,
            metrics_enabled=False,
        )
        producer.init_transactions()
        record = an_event()
        assert broker.proc is not None
        pid = broker.proc.pid

        def run(n: int, gap: float) -> dict[str, float]:
            client0, jit0 = time.process_time(), jit_seconds([pid])
            broker0 = sum(cpu_seconds([pid]))
            start = time.perf_counter()
            for _ in range(n):
                producer.begin_transaction()
                sent = [producer.send(t, key=b"k", value=record, partition=1) for t in topics]
                producer.flush()
                for future in sent:
                    future.get()
                producer.commit_transaction()
                if gap:
                    time.sleep(gap)
            wall = time.perf_counter() - start
            return {
                "per_s": n / wall,
                "client_cpu_ms": (time.process_time() - client0) / n * 1e3,
                "broker_cpu_ms": (sum(cpu_seconds([pid])) - broker0) / n * 1e3,
                "broker_jit_ms": (jit_seconds([pid]) - jit0) / n * 1e3,
            }

        rounds = []
        for i in tqdm(range(args.rounds), desc="rounds", unit="round"):
            paced = run(int(args.rate * args.seconds), 1 / args.rate)
            rounds.append({"round": i, "paced": paced, "back_to_back": run(args.back_to_back, 0)})
        producer.close()
        settled = rounds[len(rounds) // 2 :]
        return {
            "benchmark": "transactions",
            "kafka_python": kafka.__version__,
            "rate": args.rate,
            "rounds": rounds,
            "settled_medians": {
                f"{mode} {k}": statistics.median(r[mode][k] for r in settled)
                for mode in ("paced", "back_to_back")
                for k in ("per_s", "client_cpu_ms", "broker_cpu_ms", "broker_jit_ms")
            },
        }
    finally:
        broker.stop()


def broker_start(args: argparse.Namespace) -> dict[str, object]:
    from stack import class_archive

    lib = Path(".stack/lib")
    archive = class_archive.ensure_kafka(lib)
    runs: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for _ in tqdm(range(args.repeats), desc="starts", unit="pair"):
        for mode in runs:
            work = Path(tempfile.mkdtemp(prefix="logfold-bench-"))
            broker = LocalKafka(lib, work, free_port(), free_port(), class_archive=mode == "with")
            formatting = broker.format()  # (a new directory: formatted before the clock)
            assert formatting is not None and formatting.wait() == 0
            start = time.perf_counter()
            broker.launch()
            broker.wait_ready()
            assert broker.proc is not None
            took = time.perf_counter() - start
            runs[mode].append({"ready_s": took, "cpu_s": sum(cpu_seconds([broker.proc.pid]))})
            broker.stop()
            shutil.rmtree(work, ignore_errors=True)
    return with_and_without("broker-start", archive, runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    common = argparse.ArgumentParser(add_help=False)
    # As `make run` starts them (LOGFOLD_PROCESSORS, LOGFOLD_API_WORKERS).
    defaults = Settings.model_fields
    common.add_argument(
        "--processors",
        type=int,
        default=defaults["processors"].default,
        help="processor processes (default %(default)s, as `make run`)",
    )
    common.add_argument(
        "--apis",
        type=int,
        default=defaults["api_workers"].default,
        help="API processes (default %(default)s, as `make run`)",
    )
    common.add_argument("--aggregates", type=int, default=200, help="customers renamed")
    common.add_argument("--duration", type=float, default=15, help="seconds per run")
    common.add_argument("--warmup", type=float, default=45, help="seconds of load first")
    common.add_argument(
        "--set",
        dest="env",
        metavar="KEY=VALUE",
        type=lambda kv: dict([kv.split("=", 1)]),
        action=Merge,
        default={},
        help="a setting of the API and processors, e.g. LOGFOLD_API_THREADS=64 (repeatable)",
    )
    common.add_argument(
        "--broker-config",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a line of the broker's server.properties, e.g. num.io.threads=2 (repeatable)",
    )
    lo = sub.add_parser("load", parents=[common], help="commands/s and latency by offered load")
    lo.add_argument("--rates", type=float, nargs="+", default=[50, 200, 500, 1000])
    lo.add_argument("--repeats", type=int, default=3, help="runs per level (median reported)")
    lo.add_argument(
        "--library",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the eventsourcing library, side by side (a dev dependency)",
    )
    lo.add_argument("--long-events", type=int, default=3000, help="events of the long aggregate")
    co = sub.add_parser(
        "compare", parents=[common], help="closed loops against the eventsourcing library"
    )
    co.add_argument("--repeats", type=int, default=3)
    co.add_argument("--long-events", type=int, default=3000, help="events of the long aggregate")
    pr = sub.add_parser("profile", parents=[common], help="CPU per command by stage (py-spy)")
    pr.add_argument("--rate", type=float, default=300)
    pr.add_argument("--sample-rate", type=int, default=100, help="py-spy samples/s")
    ag = sub.add_parser("aggregate", help="latency on a long aggregate against a fresh one")
    ag.add_argument("--events", type=int, default=10_000)
    ag.add_argument("--commands", type=int, default=50, help="commands of each kind per run")
    ag.add_argument("--repeats", type=int, default=3)
    tx = sub.add_parser("transactions", help="CPU of a processor-shaped transaction, both sides")
    tx.add_argument(
        "--rate", type=float, default=40, help="paced: a pause of 1/RATE s after each transaction"
    )
    tx.add_argument("--seconds", type=float, default=20, help="of paced transactions per round")
    tx.add_argument("--back-to-back", type=int, default=1000, help="transactions per round")
    tx.add_argument("--rounds", type=int, default=8, help="the later half gives the medians")
    bs = sub.add_parser("broker-start", help="a broker's start with the class archive and without")
    bs.add_argument("--repeats", type=int, default=5, help="starts of each (medians reported)")
    args = parser.parse_args()
    run = {
        "load": load,
        "compare": compare,
        "profile": profile,
        "aggregate": aggregate,
        "transactions": transactions,
        "broker-start": broker_start,
    }[args.which]
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
