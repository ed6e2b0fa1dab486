"""Streams-of-facts benchmarks on the full local stack (real Kafka, Postgres, Spark).

    .venv/bin/python bench/streams.py ingest --duration 15 --repeats 3
    .venv/bin/python bench/streams.py freshness --rate 20 --duration 20 --repeats 3

ingest: `POST /streams/page_views/records` with 1,000 records a request, from `--clients`
clients in a closed loop (each sends its next request when the last was answered), through the
API processes `make run` starts, with the rest of the stack running (`--alone`: the API and
Kafka only). Records/s accepted (`202`), median of the runs. The ceiling, in the same run: a
bare kafka-python transactional producer writing the same records (same bytes, partitions and
keys) into a topic of its own, 1,000 per transaction, as one API process's ingestion does.
Request bodies are made before the clock starts.

freshness: page views posted one a request, open loop at `--rate`, each of a new customer and
a new book; per view, from the `202` to the first row it shows in (`trending_books`,
`browsing_sessions`, `book_conversions`); and `pay-order` from its `201` to its row in
`royalty_payouts`. One monitor per run polls the view for the pending keys every 10 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
from kafka import KafkaProducer
from kafka.admin import NewTopic
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import closed_loop
from bench.read_stack import (
    Stack,
    open_loop,
    start_processes,
    start_warmed,
    threaded,
    warm_up,
)
from config.settings import Settings, kafka_client_options
from events.partitioning import partition_for
from events.serialization import dumps
from stack.topics import admin_client
from streams.ingest import FactRecord
from tests.support import Processes, token

PER_REQUEST = 1000


def records(n: int, customers: int = 10_000, books: int = 500) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat(timespec="milliseconds")
    return [
        {
            "id": f"pv-{uuid.uuid4().hex}",
            "occurred_at": now,
            "data": {
                "customer_id": f"c{i % customers}",
                "book_id": f"b{(i * 7919) % books}",
            },
        }
        for i in range(n)
    ]


def raw_produce(settings: Settings, bodies: list[list[dict[str, Any]]], seconds: float) -> float:
    """Records/s of a bare transactional producer writing `bodies` (1,000 a transaction) as
    ingestion writes them, into a topic of its own, for about `seconds`."""
    topic = f"{settings.topic_prefix}ceiling.streams.{uuid.uuid4().hex[:6]}"
    admin = admin_client(settings)
    try:
        admin.create_topics([NewTopic(topic, settings.partitions, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(),
        **kafka_client_options(),
        metrics_enabled=False,
        transactional_id=f"bench-{uuid.uuid4()}",
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        batch_size=256 * 1024,
        max_request_size=2 * 1024 * 1024,
    )
    received = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    encoded = [
        [
            (
                r["id"].encode(),
                dumps(FactRecord(r["id"], r["occurred_at"], received, r["data"])),
                partition_for(r["data"]["customer_id"], settings.partitions),
            )
            for r in body
        ]
        for body in bodies
    ]
    try:
        producer.init_transactions()
        sent, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for body in encoded:
                producer.begin_transaction()
                for key, value, partition in body:
                    producer.send(topic, key=key, value=value, partition=partition)
                producer.commit_transaction()
                sent += len(body)
                if time.perf_counter() - start >= seconds:
                    break
        return sent / (time.perf_counter() - start)
    finally:
        producer.close()


def ingest(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(args.partitions)
    with stack as settings:
        procs = Processes(settings, stack.work, {"LOGFOLD_API_WORKERS": str(args.apis)})
        try:
            url, meter = start_processes(stack, procs, background=not args.alone)
            bodies = [
                json.dumps({"records": records(PER_REQUEST)}).encode()
                for _ in tqdm(range(args.bodies), desc="request bodies", unit="req")
            ]
            raw_bodies = [json.loads(b)["records"] for b in bodies[: min(len(bodies), 50)]]
            headers = {
                "Authorization": f"Bearer {token('streams:write')}",
                "Content-Type": "application/json",
            }
            sessions = [requests.Session() for _ in range(args.clients)]
            sent = [0] * args.clients
            failures: list[int] = []

            def post(w: int) -> None:
                body = bodies[(sent[w] * args.clients + w) % len(bodies)]
                sent[w] += 1
                r = sessions[w].post(
                    f"{url}/streams/page_views/records", data=body, headers=headers, timeout=60
                )
                if r.status_code != 202:
                    failures.append(r.status_code)

            closed_loop(args.clients, args.warmup, post)  # the JIT and the first segments
            runs = []
            for _ in tqdm(range(args.repeats), desc="ingest", unit="run"):
                meter.start()
                requests_per_s = closed_loop(args.clients, args.duration, post)
                cpu = meter.stop()
                ceiling = raw_produce(settings, raw_bodies, args.duration)
                runs.append(
                    {
                        "records_per_s": requests_per_s * PER_REQUEST,
                        "raw_produce_records_per_s": ceiling,
                        "cpu_pct": {k: round(v, 1) for k, v in cpu.items()},
                    }
                )
            return {
                "benchmark": "ingest",
                "apis": args.apis,
                "clients": args.clients,
                "alone": args.alone,
                "records_per_s": statistics.median(r["records_per_s"] for r in runs),
                "raw_produce_records_per_s": statistics.median(
                    r["raw_produce_records_per_s"] for r in runs
                ),
                "failures": len(failures),
                "runs": runs,
            }
        finally:
            procs.stop()


def freshness(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(args.partitions)
    with stack as settings:
        procs = Processes(settings, stack.work)
        try:
            api, _ = start_warmed(stack, procs)
            url = api.base_url
            book, buyers = warm_up(settings, api)
            stream = requests.Session()
            headers = {"Authorization": f"Bearer {token('streams:write')}"}

            def view(key: str) -> Any:
                def send(i: int) -> tuple[str, float] | None:
                    new = uuid.uuid4().hex  # a customer and a book no row has yet
                    record = {
                        "id": f"pv-{new}",
                        "occurred_at": datetime.now(UTC).isoformat(),
                        "data": {"customer_id": f"c-{new}", "book_id": f"b-{new}"},
                    }
                    r = stream.post(
                        f"{url}/streams/page_views/records",
                        json={"records": [record]},
                        headers=headers,
                        timeout=30,
                    )
                    return (
                        (record["data"][key], time.perf_counter()) if r.status_code == 202 else None
                    )

                return send

            def payment(i: int) -> tuple[str, float] | None:
                placed = api.command(
                    "place-order",
                    {
                        "customer_id": buyers[i % len(buyers)],
                        "lines": [{"book_id": book, "quantity": 1}],
                    },
                )
                if placed.status != 201:
                    return None
                order = placed.body["aggregate_id"]
                paid = api.command("pay-order", {"amount_cents": 999}, aggregate_id=order)
                return (order, time.perf_counter()) if paid.status == 201 else None

            cases = {
                "trending_books": (
                    view("book_id"),
                    "SELECT DISTINCT book_id FROM trending_books WHERE book_id = ANY(%s)",
                ),
                "browsing_sessions": (
                    view("customer_id"),
                    "SELECT DISTINCT customer_id FROM browsing_sessions "
                    "WHERE customer_id = ANY(%s)",
                ),
                "book_conversions": (
                    view("book_id"),
                    "SELECT DISTINCT book_id FROM book_conversions WHERE book_id = ANY(%s)",
                ),
                "royalty_payouts": (
                    payment,
                    "SELECT DISTINCT order_id FROM royalty_payouts WHERE order_id = ANY(%s)",
                ),
            }
            result: dict[str, Any] = {"benchmark": "streams-freshness", "rate": args.rate}
            for name, (send, sql) in cases.items():
                runs = [
                    open_loop(settings, args.rate, args.duration, threaded(send), sql)
                    for _ in tqdm(range(args.repeats), desc=name, unit="run")
                ]
                result[name] = {
                    "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                    "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                    "runs": runs,
                }
            return result
        finally:
            procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--partitions", type=int, default=4)
    common.add_argument("--duration", type=float, default=15, help="seconds per run")
    common.add_argument("--repeats", type=int, default=3, help="runs (median reported)")
    p = sub.add_parser("ingest", parents=[common], help="records/s through the API")
    p.add_argument("--apis", type=int, default=2, help="API processes (default 2, as make run)")
    p.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients")
    p.add_argument("--bodies", type=int, default=200, help="distinct request bodies")
    p.add_argument("--warmup", type=float, default=20, help="seconds of load first")
    p.add_argument(
        "--alone", action="store_true", help="only the API and Kafka (no processor, projector)"
    )
    p = sub.add_parser("freshness", parents=[common], help="record accepted -> row visible")
    p.add_argument("--rate", type=float, default=20, help="records (or payments) per second")
    args = parser.parse_args()
    run = {"ingest": ingest, "freshness": freshness}[args.which]
    print(json.dumps(run(args), indent=2, default=str))


if __name__ == "__main__":
    main()
