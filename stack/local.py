"""`logfold run`: the whole stack on one machine, on local defaults.

Starts what is not configured externally (Kafka, Postgres), prepares topics and tables, then runs
command processors and the API as child processes until Ctrl-C.

`logfold run --cluster` runs the same code as a cluster would, on this machine: three Kafka
nodes (every topic on three, written to two), a Spark standalone master with two workers (the
projector is submitted there), two command processors, and two API nodes behind a load balancer
(HAProxy) on the API's port. Its data is kept apart from the single-node stack's
(`<data>/cluster`): the two never share a log.

The children run in sessions of their own, so Ctrl-C in the terminal reaches this process alone,
which stops them, the API first, and says so in a line each. Their output comes
through this process, each line prefixed with the child's name (config/logs.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import requests

from app.auth import check_secret
from config import logs
from config.settings import Settings
from stack import stack_env
from stack.local_kafka import KafkaCluster, LocalKafka
from stack.local_lb import LoadBalancer
from stack.local_postgres import LocalPostgres
from stack.local_spark import SparkStandalone
from stack.migrate import upgrade
from stack.procs import port_open, wait_until
from stack.pulse import Pulse
from stack.topics import check_topics, create_topics

# How long `logfold run` waits for the projector's live queries before its banner: they start
# once warm and caught up with the log (seconds, unless the views have much of it to fold).
PROJECTOR_START_S = 300
# How long a child may take to stop after SIGTERM before it is killed (the API lets its open
# requests finish for up to 10 s; the projector stops its queries).
STOP_S = 30.0
# The cluster topology's sizes (`logfold run --cluster`).
CLUSTER_BROKERS = 3
CLUSTER_WORKERS = 2  # each with every slot the projector needs (`worker_slots`)
CLUSTER_API_NODES = 2
CLUSTER_PROCESSORS = 2
# A child that exits is started again (as a process supervisor would: CDC holds the one
# replication slot, a processor its partitions), unless it exited this often this recently:
# then something is wrong that a restart does not fix, and the stack stops, saying so.
RESTARTS, RESTART_WINDOW_S = 5, 300.0

log = logging.getLogger("logfold")
_output_lock = threading.Lock()


def _write(line: str) -> None:
    """A child's line to this process's stderr, whole (several relays write at once)."""
    with _output_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _libc_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None).prctl
        return prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up here, not in the forked child: a child of a process with threads (the relays) may
# only do simple things before it runs its program.
_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child, before it runs: SIGTERM when `logfold run` dies, even by SIGKILL (in a
    session of its own, Ctrl-C in the terminal no longer reaches it)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    relay: logs.Relay
    args: tuple[str, ...] = ()
    exits: list[float] = field(default_factory=list)  # when it exited and was started again


@dataclass
class Node:
    """A process of the services the stack started itself (a Kafka node, the Spark master or
    a worker, the balancer): started again when it exits, as a child is."""

    name: str
    proc: Callable[[], subprocess.Popen[bytes] | None]
    restart: Callable[[], None]  # starts it without waiting for it to be ready
    exits: list[float] = field(default_factory=list)


def load_or_create_secret(path: Path) -> str:
    """The local stack's token secret, created on first use atomically with mode 0600; two
    processes starting at once end up with the same one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        stack_env.write_private(path, secrets.token_urlsafe(48), replace=False)
    return path.read_text().strip()


def secret_for(settings: Settings) -> str:
    """The token secret: configured (LOGFOLD_JWT_SECRET, or the running local stack's), checked
    for strength. Never made up here: replicas that each invented one would reject each other's
    tokens, so without one this says how to get one."""
    if not settings.jwt_secret:
        raise RuntimeError(
            "LOGFOLD_JWT_SECRET is not set and no local stack is running here (no "
            f"{settings.data_path / 'stack.env'}): start one with `logfold run` in this "
            'directory, or `eval "$(logfold env)"` in the project of a running one, or set '
            f"LOGFOLD_JWT_SECRET to the deployment's secret"
        )
    return check_secret(settings.jwt_secret)


def worker_slots(settings: Settings) -> int:
    """The task slots each Spark worker of the cluster declares: all that the projector's
    real-time queries need (`realtime_slots`), so that either worker alone holds them. A
    worker lost then moves its tasks to the other at once; with fewer, they wait until a
    worker comes back (a minute or more), and the partitions they read wait with them."""
    from projections.registry import JOINS, PROJECTIONS
    from spark.event_pipeline import realtime_slots  # (Spark's Python modules: loaded only here)

    return realtime_slots(settings, list(PROJECTIONS.values()), list(JOINS.values()))


class LocalStack:
    def __init__(
        self, settings: Settings, say: Callable[[str], object] = log.info, cluster: bool = False
    ) -> None:
        self.settings = settings
        self.say = say
        self.cluster = cluster
        self.kafka: LocalKafka | KafkaCluster | None = None
        self.postgres: LocalPostgres | None = None
        self.spark: SparkStandalone | None = None
        self.balancer: LoadBalancer | None = None
        self.children: list[Child] = []
        self.nodes: list[Node] = []
        self.hurry = threading.Event()  # a second Ctrl-C: stop the children at once

    def _check_port(self, port: int, what: str, variable: str) -> None:
        if port_open(port):
            raise RuntimeError(
                f"port {port} for {what} is already in use: is another `logfold run` running? "
                f"Stop it, or choose another port with {variable}."
            )

    def start_services(self) -> Settings:
        s = self.settings
        data = s.data_path / "cluster" if self.cluster else s.data_path
        # Kafka, Spark and Postgres need nothing of each other to start: each is launched
        # (Postgres' initdb runs while the JVMs start), then each waited for, then watched.
        if not s.kafka_bootstrap_servers and self.cluster:
            # Each node a client port and a controller port: 19092/19093, 19094/19095, …
            ports = [(s.kafka_port + 2 * i, s.kafka_port + 2 * i + 1) for i in range(3)]
            for port, _ in ports:
                self._check_port(port, "Kafka", "LOGFOLD_KAFKA_PORT")
            self.say(
                f"starting Kafka: {CLUSTER_BROKERS} nodes on 127.0.0.1:"
                f"{', '.join(str(p) for p, _ in ports)} (data in {data / 'kafka'})"
            )
            self.kafka = KafkaCluster(s.lib_path, data / "kafka", ports)
            self.kafka.launch()
        elif not s.kafka_bootstrap_servers:
            self._check_port(s.kafka_port, "Kafka", "LOGFOLD_KAFKA_PORT")
            self.say(f"starting Kafka on 127.0.0.1:{s.kafka_port} (data in {data / 'kafka'})")
            self.kafka = LocalKafka(s.lib_path, data / "kafka", s.kafka_port, s.kafka_port + 1)
            self.kafka.launch()
        if self.cluster and "spark_master" not in s.model_fields_set:
            self.say(f"starting Spark: a standalone master and {CLUSTER_WORKERS} workers")
            self.spark = SparkStandalone(data / "spark", CLUSTER_WORKERS, worker_slots(s))
            self.spark.launch()
        if not s.database_url:
            self._check_port(s.postgres_port, "Postgres", "LOGFOLD_POSTGRES_PORT")
            self.say(f"starting Postgres on 127.0.0.1:{s.postgres_port} (data in {data / 'pg'})")
            self.postgres = LocalPostgres(data / "pg", s.postgres_port)
            self.postgres.launch()

        if self.spark is not None:
            self.spark.wait_ready()  # first: its workers start once its master listens
            s.spark_master = self.spark.url
            spark = self.spark
            self.nodes.append(
                Node("the Spark master", lambda: spark.master_proc, spark.start_master)
            )
            for i in range(len(spark.workers)):
                self.nodes.append(
                    Node(
                        f"Spark worker {i + 1}",
                        partial(spark.workers.__getitem__, i),
                        partial(spark.start_worker, i),
                    )
                )
        if isinstance(self.kafka, KafkaCluster):
            self.kafka.wait_ready()
            for node in self.kafka.nodes:
                self._supervised(f"Kafka node {node.node_id}", node, node.launch)
            if "replication_factor" not in s.model_fields_set:
                s.replication_factor = CLUSTER_BROKERS
        elif self.kafka is not None:
            self.kafka.wait_ready()
            self._supervised("Kafka", self.kafka, self.kafka.launch)
        if self.kafka is not None:
            s.kafka_bootstrap_servers = self.kafka.bootstrap
        if self.postgres is not None:
            self.postgres.wait_ready()
            s.database_url = self.postgres.url
        s.jwt_secret = check_secret(
            s.jwt_secret or load_or_create_secret(s.data_path / "jwt-secret")
        )
        created = create_topics(s)
        if created:
            self.say(f"created topics: {', '.join(created)}")
        check_topics(s)
        upgrade(s.database())
        if self.postgres is not None and not s.api_database_url:
            s.api_database_url = self.postgres.api_url()  # reads views, writes nothing
        return s

    def endpoints(self) -> dict[str, str]:
        """What a process needs to join this stack (also what `logfold env` prints)."""
        s = self.settings
        return {
            "KAFKA_BOOTSTRAP_SERVERS": s.kafka(),
            "DATABASE_URL": s.database(),
            "LOGFOLD_JWT_SECRET": s.jwt_secret or "",
            "LOGFOLD_TOPIC_PREFIX": s.topic_prefix,
            "LOGFOLD_PARTITIONS": str(s.partitions),
            # What the API accepts of a token: `logfold token` in another shell issues it so.
            "LOGFOLD_JWT_AUDIENCE": s.jwt_audience,
            "LOGFOLD_JWT_MAX_TTL_S": str(s.jwt_max_ttl_s),
            "LOGFOLD_REPLICATION_FACTOR": str(s.replication_factor),
            "LOGFOLD_SPARK_MASTER": s.spark_master,
            **({"LOGFOLD_API_DATABASE_URL": s.api_database_url} if s.api_database_url else {}),
        }

    def env(self) -> dict[str, str]:
        # On a Spark cluster the executors run this Python (with Logfold's packages) too.
        spark = {"PYSPARK_PYTHON": sys.executable} if self.spark is not None else {}
        return {**os.environ, **self.endpoints(), **spark}

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start `logfold <args>` as the child `name`: its output relayed, prefixed; its logs
        as text unless LOGFOLD_LOG_FORMAT says otherwise."""
        env = {**self.env(), "LOGFOLD_LOG_FORMAT": os.environ.get("LOGFOLD_LOG_FORMAT", "text")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert proc.stdout is not None
        relay = logs.Relay(name, proc.stdout, _write, debug=logs.is_debug(self.settings.log_level))
        self.children.append(Child(name, proc, relay, args))
        return proc

    def supervise(self) -> None:
        """Start again each child or node that exited; raise when one keeps exiting."""
        now = time.monotonic()
        for i, child in enumerate(self.children):
            code = child.proc.poll()
            if code is None:
                continue
            recent = self._exited(child.name, code, child.exits, now)
            child.relay.join(5.0)
            self.spawn(child.name, *child.args)
            restarted = self.children.pop()
            restarted.exits = recent
            self.children[i] = restarted
        for node in self.nodes:
            proc = node.proc()
            if proc is None or proc.poll() is None:
                continue
            node.exits = self._exited(node.name, proc.returncode, node.exits, now)
            node.restart()

    def _supervised(self, name: str, service: Any, restart: Callable[[], None]) -> None:
        """Watch `service.proc` (a process the stack started itself); `restart` when it exits."""
        self.nodes.append(Node(name, lambda: service.proc, restart))

    def _exited(self, name: str, code: int, exits: list[float], now: float) -> list[float]:
        recent = [t for t in exits if now - t < RESTART_WINDOW_S] + [now]
        if len(recent) > RESTARTS:
            raise RuntimeError(
                f"{name} exited with {code} {len(recent)} times in "
                f"{RESTART_WINDOW_S:.0f} s (its lines above say why)"
            )
        self.say(f"{name} exited with {code}; starting it again")
        return recent

    def start_processes(self) -> None:
        s = self.settings
        self._check_port(s.api_port, "the API", "LOGFOLD_API_PORT")
        processors = max(s.processors, CLUSTER_PROCESSORS) if self.cluster else s.processors
        for n in range(processors):
            self.spawn("processor" if processors == 1 else f"processor-{n + 1}", "processor")
        self._projector_spawned = self._database_now()
        projector = self.spawn("projector", "projector")
        self.spawn("cdc", "cdc")
        self.spawn("webhooks", "webhooks")
        if self.cluster:
            # The nodes on the ports after the API's; the balancer on the API's own.
            nodes = [s.api_port + i for i in range(1, CLUSTER_API_NODES + 1)]
            for i, port in enumerate(nodes, start=1):
                self._check_port(port, f"API node {i}", "LOGFOLD_API_PORT")
                self.spawn(f"api-{i}", "api", "--host", "127.0.0.1", "--port", str(port))
            self.say(f"starting the load balancer (HAProxy) on {s.api_host}:{s.api_port}")
            self.balancer = LoadBalancer(s.data_path / "cluster" / "lb", s.api_port, nodes)
            self.balancer.start()
            self._supervised("the load balancer", self.balancer, self.balancer.start)
        else:
            self.spawn("api", "api", "--host", s.api_host, "--port", str(s.api_port))
        url = f"http://{s.api_host}:{s.api_port}/health"
        wait_until(lambda: requests.get(url, timeout=2).status_code == 200, 90, url)
        self.say("waiting for the Spark projector to warm up and start its queries…")
        try:
            wait_until(self._projector_started, PROJECTOR_START_S, "the projector's queries")
        except TimeoutError:
            if projector.poll() is not None:
                raise
            # Its queries start live once they have caught up with the log: a long log the
            # views have not seen yet takes a while. They serve meanwhile, lagging.
            self.say(
                "the projector is still catching up with the log; views lag until it has "
                "(their lag: /health, /views)"
            )

    def cluster_lines(self) -> str:
        """The banner's lines about the cluster topology (none without `--cluster`)."""
        lines = []
        if self.balancer is not None:
            nodes = ", ".join(f":{p}" for p in self.balancer.backends)
            lines.append(
                f"  API nodes  {nodes} behind HAProxy on :{self.balancer.port} "
                f"(its stats: http://127.0.0.1:{self.balancer.stats_port}/)"
            )
        if self.spark is not None:
            lines.append(
                f"  Spark      {self.spark.url} with {CLUSTER_WORKERS} workers "
                f"(UI: http://127.0.0.1:{self.spark.ui_port}/)"
            )
        if isinstance(self.kafka, KafkaCluster):
            lines.append(
                f"  topics     on {self.settings.replication_factor} nodes each, "
                "written to 2 (min.insync.replicas)"
            )
        return "".join(f"\n{line}" for line in lines)

    def _database_now(self) -> datetime:
        import psycopg

        with psycopg.connect(self.settings.database()) as conn:
            row = conn.execute("SELECT now()").fetchone()
        assert row is not None and isinstance(row[0], datetime)
        return row[0]

    def _projector_started(self) -> bool:
        """Every fold's query has started (after its warm-up) since the projector was spawned."""
        import psycopg

        from projections.registry import FOLDS

        with psycopg.connect(self.settings.database()) as conn:
            rows = conn.execute(
                "SELECT projection FROM projection_progress WHERE started_at >= %s",
                (self._projector_spawned,),
            ).fetchall()
        return {r[0] for r in rows} >= set(FOLDS)

    def stop(self) -> None:
        """Stop the API first (its nodes finish the requests they are answering), then the
        load balancer, then the other children together (each stops on its own: none needs
        another to), then Spark, Postgres and Kafka together: a line each."""
        api = [c for c in self.children if c.name == "api" or c.name.startswith("api-")]
        _together(self._stop, api)
        if self.balancer is not None:
            self.balancer.stop()
            self.say("stopped the load balancer")
        _together(self._stop, [c for c in reversed(self.children) if c not in api])
        self.children.clear()
        running = (
            ("Spark", self.spark.stop if self.spark is not None else None),
            ("Postgres", self.postgres.stop if self.postgres is not None else None),
            ("Kafka", self.kafka.stop if self.kafka is not None else None),
        )
        stops = {name: stop for name, stop in running if stop is not None}
        _together(lambda name: self._stop_engine(name, stops[name]), list(stops))

    def _stop_engine(self, name: str, stop: Callable[[], object]) -> None:
        stop()
        self.say(f"stopped {name}")

    def _stop(self, child: Child) -> None:
        """SIGTERM, and SIGKILL after STOP_S (or at a second Ctrl-C). What the child prints
        meanwhile is held back (config/logs.py, Relay) and shown only if it does not stop
        cleanly."""
        proc, started = child.proc, time.monotonic()
        if proc.poll() is not None:
            self.say(f"{child.name} had exited ({proc.returncode})")
            return
        child.relay.withhold()
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and time.monotonic() - started < STOP_S:
            self.hurry.wait(0.05)
            if self.hurry.is_set():
                break
        killed = proc.poll() is None
        if killed:
            proc.kill()
        proc.wait()
        child.relay.join(5.0)  # a JVM it started may hold the pipe a moment longer
        if killed:
            self.say(f"{child.name} did not stop within {time.monotonic() - started:.0f} s: killed")
        elif proc.returncode not in (0, -signal.SIGTERM):  # the latter: before its handler
            self.say(f"{child.name} exited with {proc.returncode} while stopping")
        else:
            self.say(f"stopped {child.name} ({time.monotonic() - started:.1f} s)")
            return
        for line in child.relay.held():
            _write(line)


def _together(stop: Callable[[Any], object], things: list[Any]) -> None:
    """`stop` each of `things`, each in a thread of its own; return when all have stopped
    (raising the first error, once all have)."""
    if not things:
        return
    with ThreadPoolExecutor(max_workers=len(things)) as pool:
        for done in [pool.submit(stop, thing) for thing in things]:
            done.result()


def run(settings: Settings, cluster: bool = False) -> None:
    from app.auth import issue_token

    running = stack_env.read(settings)
    if running is not None:
        raise RuntimeError(
            f"a local stack is already running here (`logfold run`, pid {running[stack_env.PID]}); "
            'stop it first, or use it: `eval "$(logfold env)"`'
        )
    stack = LocalStack(settings, cluster=cluster)
    pulse: Pulse | None = None
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    # Ctrl-C stops everything, even when `run` was started with SIGINT ignored: a
    # non-interactive shell ignores it in what it starts with `&` (a script, CI), and Python
    # then leaves it ignored instead of raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.start_services()
        stack.start_processes()
        base = f"http://{settings.api_host}:{settings.api_port}"
        stack_env.write(settings, {**stack.endpoints(), "LOGFOLD_API_URL": base})
        ttl = settings.jwt_max_ttl_s  # the longest the API accepts (24 h by default)
        token = issue_token(settings.jwt_secret or "", ttl_s=ttl, audience=settings.jwt_audience)
        print(
            f"""
Logfold is running.
  API        {base}   (docs: {base}/docs, contract: {base}/openapi.json)
  views      {base}/views   (Spark projector: {settings.spark_master})
  live page  {base}/live#token=$TOKEN   (websocket: {base.replace("http", "ws", 1)}/ws)
  health     {base}/health
  Kafka      {settings.kafka()}
  Postgres   {settings.database()}{stack.cluster_lines()}

Development token (all scopes, valid {ttl / 3600:g} h; `logfold token` prints another):
  export TOKEN={token}

Try:
  curl -X POST {base}/commands/register-customer \\
       -H 'Content-Type: application/json' -H "Authorization: Bearer $TOKEN" \\
       -d '{{"data": {{"name": "Ada", "email": "ada@example.com"}}}}'

Ctrl-C stops everything; data stays in {settings.data_path} (`logfold reset` wipes it).
""",
            flush=True,
        )
        pulse = Pulse(settings, f"{base}/health")
        pulse.start()
        while not stopped.wait(0.5):
            stack.supervise()
    except KeyboardInterrupt:
        pass
    finally:
        # Another Ctrl-C (or SIGTERM) while stopping: the children are killed, not waited for.
        signal.signal(signal.SIGINT, lambda *_: stack.hurry.set())
        signal.signal(signal.SIGTERM, lambda *_: stack.hurry.set())
        stack.say("stopping… (Ctrl-C again: at once)")
        if pulse is not None:
            pulse.stop()
        stack_env.remove(settings)
        stack.stop()
