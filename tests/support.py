"""Shared by integration and e2e tests: tokens, API clients, reading the log, child processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import requests
from flask import Flask
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import PolicyViolationError

from app.auth import SCOPES, issue_token
from cdc.changes import Change, WalPosition, record_for
from config.settings import Settings, kafka_client_options, kafka_consumer_options
from config.topics import Topics
from events.base import DomainEvent
from events.keys import find_keys, open_value, subject
from events.partitioning import partition_for
from events.serialization import Envelope, encode, envelope_for
from events.store import read_events
from stack.migrate import upgrade
from stack.procs import free_port, stop_process, wait_until
from stack.topics import create_topics, topic_spec

REPO = Path(__file__).resolve().parents[1]
SECRET = "test-secret-not-for-production-use-0123456789"


def token(
    *scopes: str, subject: str = "tester", ttl: int = 3600, rows: dict[str, str] | None = None
) -> str:
    return issue_token(SECRET, subject, scopes or SCOPES, ttl, rows)


def topic_records(settings: Settings, topic: str) -> list[Any]:
    """Every record of `topic`, read from its start to its end as it is now."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(), enable_auto_commit=False, **kafka_consumer_options()
    )
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        found: list[Any] = []
        while any(consumer.position(tp) < ends[tp] for tp in parts):
            for records in consumer.poll(timeout_ms=1000).values():
                found += records
        return found
    finally:
        consumer.close()


def send_again(settings: Settings, record: Any, *values: dict[str, Any]) -> None:
    """Write `values` (JSON) to `record`'s topic under its key, each acknowledged."""
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(), acks="all", **kafka_client_options()
    )
    try:
        for value in values:
            producer.send(record.topic, key=record.key, value=json.dumps(value).encode()).get(30)
    finally:
        producer.close(timeout=10)


def append_changes(settings: Settings, table: str, changes: list[tuple[Any, ...]]) -> None:
    """Write changes of `table` straight into its changelog `cdc.<table>` as the CDC process
    would (for tests that must not depend on it): each is (op, key, row, "<lsn>.<seq>"); for a
    delete, `row` is the deleted row (the before-image)."""
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(), acks="all", **kafka_client_options()
    )
    topic = Topics(settings.topic_prefix).cdc(table)
    for op, key, row, position in changes:
        deleted = op == "delete"
        change = Change(
            table,
            op,
            key,
            None if deleted else row,
            row if deleted else None,
            WalPosition.parse(position),
        )
        k, v, headers = record_for(change, datetime.now(UTC))
        producer.send(topic, key=k, value=v, headers=headers, partition=0)
    producer.flush()
    producer.close()


def tables_holding(settings: Settings, *values: str) -> dict[str, int]:
    """Rows of every table that hold any of `values` anywhere in them, per table."""
    found = {}
    with psycopg.connect(settings.database()) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        ]
        for table in tables:
            row = conn.execute(
                f"SELECT count(*) FROM {table} t WHERE "
                + " OR ".join("strpos(t::text, %s) > 0" for _ in values),
                values,
            ).fetchone()
            if row and row[0]:
                found[table] = int(row[0])
    return found


def cli_env(settings: Settings, home: Path) -> dict[str, str]:
    """The environment a `logfold` command of `settings`' deployment runs with (`home`: its
    own, with no local stack's settings to take)."""
    return {
        "DATABASE_URL": settings.database(),
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka(),
        "LOGFOLD_TOPIC_PREFIX": settings.topic_prefix,
        "LOGFOLD_HOME": str(home),
    }


def new_deployment(base: Settings, **overrides: Any) -> Settings:
    """Settings for a fresh, isolated deployment on the shared broker and server: its own topic
    prefix and its own database, migrated to the latest revision."""
    name = f"t{uuid.uuid4().hex[:10]}"
    database = base.database().rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(base.database(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(database)
    settings = base.model_copy(
        update={"topic_prefix": f"{name}.", "database_url": database, **overrides}
    )
    create_topics(settings)
    return settings


@contextlib.contextmanager
def served(settings: Settings) -> Iterator[tuple[str, Flask]]:
    """The API app for `settings` on a free port of this process (werkzeug, threaded, so
    websockets work): its websocket URL and the app; stopped and closed on exit."""
    from werkzeug.serving import make_server

    from app import close_app, create_app

    app = create_app(settings)
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    threading.Thread(target=server.serve_forever, name="api", daemon=True).start()
    try:
        yield f"ws://127.0.0.1:{port}/ws", app
    finally:
        server.shutdown()
        close_app(app)


@contextlib.contextmanager
def servers(settings: Settings) -> Iterator[Callable[..., tuple[str, Flask]]]:
    """`start(**overrides)` serves an API for `settings` with those overrides (as `served`):
    its websocket URL and app. On exit every one started is stopped and closed, all at once:
    one after another, the dozen a module starts cost it seconds each."""
    from concurrent.futures import ThreadPoolExecutor

    running: list[contextlib.AbstractContextManager[tuple[str, Flask]]] = []

    def start(**overrides: Any) -> tuple[str, Flask]:
        one = served(settings.model_copy(update=overrides))
        started = one.__enter__()
        running.append(one)
        return started

    try:
        yield start
    finally:
        with ThreadPoolExecutor(max(len(running), 1)) as pool:
            list(pool.map(lambda one: one.__exit__(None, None, None), running))


def end_offset(settings: Settings, topic: str, partition: int = 0) -> int:
    """The end offset of one partition of `topic`, as it is now."""
    return _offset(settings, topic, partition, start=False)


def start_offset(settings: Settings, topic: str, partition: int = 0) -> int:
    """The first offset one partition of `topic` holds now (after retention or deletions)."""
    return _offset(settings, topic, partition, start=True)


def _offset(settings: Settings, topic: str, partition: int, start: bool) -> int:
    consumer = KafkaConsumer(bootstrap_servers=settings.kafka(), **kafka_consumer_options())
    try:
        tp = TopicPartition(topic, partition)
        found = consumer.beginning_offsets([tp]) if start else consumer.end_offsets([tp])
        return int(found[tp])
    finally:
        consumer.close()


def delete_records(settings: Settings, topic: str, before: int) -> None:
    """Delete `topic`'s records before offset `before`, as retention (or compaction past
    `delete.retention.ms`) removes them."""
    spec = topic_spec(Topics(settings.topic_prefix), topic)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka(), **kafka_client_options())

    def policy(value: str) -> None:  # AlterConfigs resets what it is not given: give it all
        configs = {**spec.configs, "cleanup.policy": value}
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])

    def deleted() -> bool:
        try:
            admin.delete_records({TopicPartition(topic, 0): before})
        except PolicyViolationError:  # the broker has not applied the new policy yet
            return False
        return True

    try:
        policy("compact,delete")  # Kafka deletes records only from topics that allow it
        # A broker applies a topic's new config when its metadata reaches it, a moment after
        # AlterConfigs answers: until then it refuses to delete from a compacted topic.
        wait_until(deleted, 30, f"{topic} to allow deleting records", fail_fast=True)
        policy("compact")
    finally:
        admin.close()


class Joins:
    """Join pipelines of a deployment, in this process (as the projector runs them)."""

    def __init__(self, settings: Settings, spark: Any, joins: tuple[Any, ...]) -> None:
        from spark.projector import Projector

        self.projector = Projector(settings, spark, projections=(), joins=joins)

    def start(self) -> None:
        self.projector.start("joins")

    def stop(self) -> None:
        for query in self.projector.queries.values():
            query.stop()
        self.projector.queries.clear()


def fill_log(settings: Settings, topic: str, partitions: int, records: int) -> None:
    """`records` placeholder records (not events) in each of `partitions` partitions of
    `topic`: for tests that write view rows and progress themselves and wait for positions
    (one past the log's end is refused at once), with no projector reading the topic."""
    producer = KafkaProducer(bootstrap_servers=settings.kafka(), **kafka_client_options())
    try:
        for partition in range(partitions):
            for i in range(records):
                producer.send(topic, b"{}", f"x:{i}".encode(), partition=partition)
        producer.flush(timeout=30)
    finally:
        producer.close()


def append_events(
    settings: Settings,
    aggregate_type: str,
    aggregate_id: str,
    *events: tuple[int, DomainEvent, str],
    transactional: bool = True,
    logged_at: datetime | None = None,
) -> None:
    """Write (version, event, occurred_at ISO) straight into the log, as the processor would
    (in a transaction, so the log's offsets and markers are as the read side expects them): for
    tests that need events the domain would not produce now (old or late ones).
    `transactional=False`: one offset a record, no markers (for tests that count offsets).
    `logged_at`: the records' log time (Kafka timestamp), now by default."""
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(),
        **kafka_client_options(),
        transactional_id=f"test-{uuid.uuid4()}" if transactional else None,
        acks="all",
        # kafka-python gives a broker 2 s to answer its first request, then raises
        # NoBrokersAvailable: too little beside a Spark driver starting on a loaded machine.
        api_version_auto_timeout_ms=30_000,
    )
    if transactional:
        producer.init_transactions()
        producer.begin_transaction()
    for version, event, occurred_at in events:
        envelope = envelope_for(
            event,
            event_id=str(uuid.uuid4()),
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            version=version,
            occurred_at=occurred_at,
            command_id="test",
            correlation_id="test",
            causation_id="test",
        )
        producer.send(
            Topics(settings.topic_prefix).events(aggregate_type),
            key=f"{aggregate_id}:{version}".encode(),
            value=encode(envelope),
            partition=partition_for(aggregate_id, settings.partitions),
            timestamp_ms=None if logged_at is None else round(logged_at.timestamp() * 1e3),
        )
    if transactional:
        producer.commit_transaction()
    producer.flush()
    producer.close()


def log_of(settings: Settings, aggregate_type: str, opened: bool = True) -> list[Envelope]:
    """The events of `aggregate_type` in log order; with their personal fields opened with
    their subjects' keys (`[erased]` once gone), unless not `opened`: as stored, sealed."""
    log = read_events(settings.kafka(), Topics(settings.topic_prefix).events(aggregate_type))
    if not opened:
        return log
    with psycopg.connect(settings.database()) as conn:
        keys = find_keys(conn, [subject(aggregate_type, e.aggregate_id) for e in log])
    return [
        dataclasses.replace(
            e,
            data={
                k: open_value(keys.get(who), who, v)
                for k, v in e.data.items()
                for who in [subject(aggregate_type, e.aggregate_id)]
            },
        )
        for e in log
    ]


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]


class HttpApi:
    """A client of a running API process."""

    def __init__(self, base_url: str, bearer: str | None = None) -> None:
        self.base_url = base_url
        self.session = requests.Session()
        self.bearer = bearer if bearer is not None else token()

    def command(
        self,
        name: str,
        data: dict[str, Any],
        aggregate_id: str | None = None,
        expected_version: int | None = None,
        key: str | None = None,
        timeout: float = 30,
    ) -> Answer:
        body: dict[str, Any] = {"data": data}
        if aggregate_id is not None:
            body["aggregate_id"] = aggregate_id
        if expected_version is not None:
            body["expected_version"] = expected_version
        headers = {"Authorization": f"Bearer {self.bearer}"}
        if key is not None:
            headers["Idempotency-Key"] = key
        r = self.session.post(
            f"{self.base_url}/commands/{name}", json=body, headers=headers, timeout=timeout
        )
        return Answer(r.status_code, r.json(), dict(r.headers))

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.session.get(f"{self.base_url}{path}", timeout=30, **kwargs)


def projector_session(settings: Settings, app_name: str) -> Any:
    """A Spark session in this process with the projector's task slots (its real-time queries
    hold one per partition they read)."""
    from projections.registry import JOINS, PROJECTIONS
    from spark.event_pipeline import realtime_slots
    from spark.session import session

    slots = realtime_slots(settings, list(PROJECTIONS.values()), list(JOINS.values()))
    return session(settings, app_name, slots=slots)


def cli(settings: Settings, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`logfold <args>` for the deployment `settings`, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args],
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Settings the test suite gives every process it starts here (`tests/conftest.py` fills it);
# a benchmark's processes, started by the same helpers, keep the defaults.
SUITE_ENV: dict[str, str] = {}


def child_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGFOLD_")}
    env.update(
        {
            "KAFKA_BOOTSTRAP_SERVERS": settings.kafka(),
            "DATABASE_URL": settings.database(),
            "LOGFOLD_JWT_SECRET": SECRET,
            "LOGFOLD_TOPIC_PREFIX": settings.topic_prefix,
            "LOGFOLD_PARTITIONS": str(settings.partitions),
            "LOGFOLD_COMMAND_TIMEOUT_S": str(settings.command_timeout_s),
            "LOGFOLD_PROJECTOR_WARM_UP_ROUNDS": str(settings.projector_warm_up_rounds),
            "LOGFOLD_LOG_LEVEL": "WARNING",
            # One process per `logfold api`: tests and benchmarks reason about one process's
            # limits (websockets admitted, threads) and start several when they want several.
            "LOGFOLD_API_WORKERS": "1",
            **SUITE_ENV,
        }
    )
    return env


class Processes:
    """API and processor processes of one deployment, started with the real CLI."""

    def __init__(self, settings: Settings, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.settings, self.logdir = settings, logdir
        self.env = env or {}  # extra `LOGFOLD_*` settings (children do not inherit the parent's)
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.logdir / f"{name}-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", *args],
            cwd=REPO,
            env={**child_env(self.settings), **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def processor(self) -> subprocess.Popen[bytes]:
        return self._spawn("processor", "processor")

    def api(self, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
        port = port or free_port()
        proc = self._spawn("api", "api", "--port", str(port))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(f"{url}/openapi.json", timeout=2).ok, 60, f"API at {url}")
        return proc, url

    def projector(self) -> subprocess.Popen[bytes]:
        return self._spawn("projector", "projector")

    def kill_9_projector(self) -> subprocess.Popen[bytes]:
        """`kill -9` the projector started last (mid-batch, likely), and start another."""
        victim = self.procs[-1]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        return self.projector()

    def cdc(self) -> subprocess.Popen[bytes]:
        return self._spawn("cdc", "cdc")

    def webhooks(self) -> subprocess.Popen[bytes]:
        return self._spawn("webhooks", "webhooks")

    def wait_processing(self, api_url: str, processors: int, timeout: float = 60) -> None:
        """Until /health shows `processors` members in the processors' group."""

        def ready() -> bool:
            h = requests.get(f"{api_url}/health", timeout=5).json()
            return int(h["components"]["command_processing"].get("processors", 0)) >= processors

        wait_until(ready, timeout, f"{processors} command processors")

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def drop_cdc_slot(settings: Settings, timeout: float = 30) -> None:
    """Drop the deployment's replication slot once its CDC process has let go of it, so test
    deployments do not keep WAL (and slots) after they end."""
    from cdc.capture import drop

    def dropped() -> bool:
        try:
            drop(settings)
            return True
        except psycopg.errors.ObjectInUse:
            return False

    wait_until(dropped, timeout, "the replication slot to be released")


def descendants(parent: int) -> list[int]:
    """Every live descendant of `parent`, children first."""
    try:
        kids = [int(k) for k in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in descendants(k)]


def cmdline(pid: int) -> str:
    """What process `pid` runs, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def kill_tree(pid: int) -> None:
    """kill -9 a process and its descendants (gunicorn's master and its workers)."""
    import signal

    family = [pid, *descendants(pid)]
    for member in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def health_component(
    client: Any,
    name: str,
    until: Callable[[dict[str, Any]], bool],
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> dict[str, Any]:
    """Component `name` of `/health` (a Flask test client's) once `until` holds for it: the
    checks run in the background, so a change shows within a round or two."""
    seen: dict[str, Any] = {}

    def shown() -> bool:
        seen.update(client.get("/health", headers=headers or {}).json["components"])
        return name in seen and until(seen[name])

    wait_until(shown, timeout, f"/health's {name} to change (last: {seen.get(name)})")
    return dict(seen[name])


def caught_up(settings: Settings, timeout: float = 120) -> None:
    """Until every fold (projection and join) has applied the whole log."""
    from app.read_model import ReadModel

    model = ReadModel(settings)
    try:
        wait_until(
            lambda: all(v["events"] == 0 for v in model.lag().values()),
            timeout,
            "every projection to catch up with the log",
        )
    finally:
        model.engine.dispose()
