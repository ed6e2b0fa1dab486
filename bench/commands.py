"""Write-side benchmark: sustained commands/s and latency at several offered loads, on the full
local stack (real Kafka broker, `logfold processor` and `logfold api` processes), and, in the
same run, the raw kafka-python transactional produce rate of records of the same size.

    .venv/bin/python bench/commands.py --rates 25 50 100 200 --duration 20 --repeats 3

Load is open-loop: requests are scheduled at a fixed rate and latency is measured from the
scheduled send time, so a slow server cannot hide its queueing (no coordinated omission).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kafka import KafkaProducer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.customer import CustomerRenamed
from events.serialization import encode, envelope_for
from stack.local_kafka import LocalKafka
from stack.local_postgres import LocalPostgres
from stack.procs import free_port
from stack.settings import Settings
from stack.topics import create_topics
from tests.support import SECRET, HttpApi, Processes, token


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def offered_load(apis: list[HttpApi], ids: list[str], rate: float, duration: float) -> dict:
    """Rename customers at `rate` commands/s for `duration` s; latency from scheduled time."""
    total = int(rate * duration)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    start = time.perf_counter() + 0.5

    def one(i: int) -> None:
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        api = apis[i % len(apis)]
        answer = api.command("rename-customer", {"name": f"n{i}"}, aggregate_id=ids[i % len(ids)])
        elapsed = time.perf_counter() - scheduled
        with lock:
            latencies.append(elapsed)
            statuses[answer.status] = statuses.get(answer.status, 0) + 1

    with ThreadPoolExecutor(max_workers=min(256, int(rate * 2) + 8)) as pool:
        list(pool.map(one, range(total)))
    wall = time.perf_counter() - start
    ok = statuses.get(201, 0)
    return {
        "offered": rate,
        "completed_per_s": ok / wall,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "statuses": statuses,
    }


def raw_produce(bootstrap: str, topic: str, record: bytes, seconds: float, per_txn: int) -> float:
    """Records/s of a transactional kafka-python producer, `per_txn` records per transaction."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--duration", type=float, default=20, help="seconds per load level")
    parser.add_argument("--repeats", type=int, default=3, help="runs per level (median reported)")
    parser.add_argument("--processors", type=int, default=2)
    parser.add_argument("--apis", type=int, default=2)
    parser.add_argument("--aggregates", type=int, default=200)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="logfold-bench-"))
    work.chmod(0o755)
    kafka = LocalKafka(Path(".stack/lib"), work / "kafka", free_port(), free_port())
    pg = LocalPostgres(work / "pg", free_port())
    kafka.start()
    pg.start()
    settings = Settings(
        kafka_bootstrap_servers=kafka.bootstrap,
        database_url=pg.url,
        jwt_secret=SECRET,
        topic_prefix="bench.",
        partitions=4,
    )
    create_topics(settings)
    procs = Processes(settings, work)
    try:
        for _ in range(args.processors):
            procs.processor()
        urls = [procs.api()[1] for _ in range(args.apis)]
        procs.wait_processing(urls[0], args.processors)
        apis = [HttpApi(url, token()) for url in urls]
        ids = []
        for i in tqdm(range(args.aggregates), desc="creating customers", unit="cmd"):
            ids.append(
                apis[0]
                .command("register-customer", {"name": f"c{i}", "email": f"c{i}@example.com"})
                .body["aggregate_id"]
            )
        offered_load(apis, ids, 20, 5)  # warm-up
        results = []
        for rate in tqdm(args.rates, desc="load levels", unit="level"):
            runs = [offered_load(apis, ids, rate, args.duration) for _ in range(args.repeats)]
            results.append(
                {
                    "offered_per_s": rate,
                    "completed_per_s": statistics.median(r["completed_per_s"] for r in runs),
                    "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                    "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                    "statuses": [r["statuses"] for r in runs],
                }
            )
        event = envelope_for(
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
        record = encode(event)
        ceilings = {}
        for per_txn in (1, 100):
            ceilings[f"raw_txn_produce_{per_txn}_per_txn"] = statistics.median(
                raw_produce(kafka.bootstrap, "bench.events.customer", record, 5, per_txn)
                for _ in range(args.repeats)
            )
        print(
            json.dumps(
                {
                    "record_bytes": len(record),
                    "levels": results,
                    "ceilings_records_per_s": ceilings,
                    "processors": args.processors,
                    "apis": args.apis,
                },
                indent=2,
            )
        )
    finally:
        procs.stop()
        pg.stop()
        kafka.stop()


if __name__ == "__main__":
    main()
