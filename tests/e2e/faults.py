"""Faults injected into the cluster `logfold run --cluster` started, under load (tests/e2e/
test_cluster.py): its processes found by what they run, commands posted open-loop through the
balancer (every other one with an Idempotency-Key), websocket clients that follow a view through
the balancer and resume with `since` when their node goes, and the checks of what the log, the
views and the clients hold once the fault is over."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psycopg
import requests
import websocket
from dotenv import dotenv_values
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaError

from commands.messages import LogPosition
from config.settings import Settings, kafka_client_options, kafka_consumer_options
from config.topics import Topics
from stack.local_lb import LoadBalancer
from stack.procs import wait_until
from tests.changes import changelog, distinct
from tests.e2e.test_local_stack import RunningStack
from tests.integration.load import (
    Clients,
    Logical,
    committed_problems,
    send,
    status_counts,
    until_answered,
    version_problems,
)
from tests.support import REPO, caught_up, cmdline, descendants, kill_tree, log_of
from tests.wsclient import WsClient, fold

RATE = 20  # commands a second, whatever the answers (open loop)
WATCHED = 6  # customers whose changes the websocket clients follow
GIVE_UP_S = 120  # a command with a key is sent again until answered, for this long at most


@dataclass
class Cluster:
    """The running `logfold run --cluster` and what a test needs to reach into it."""

    stack: RunningStack
    token: str

    @cached_property
    def settings(self) -> Settings:
        """The deployment's, as `logfold run` wrote them for other processes (stack.env)."""
        env = dotenv_values(self.stack.data_dir / "stack.env")
        return Settings(
            kafka_bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"],
            database_url=env["DATABASE_URL"],
            topic_prefix=env["LOGFOLD_TOPIC_PREFIX"] or "",
            partitions=int(env["LOGFOLD_PARTITIONS"] or 0),
            jwt_secret=env["LOGFOLD_JWT_SECRET"],
        )

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def pids(self, *needles: str) -> list[int]:
        """The stack's processes whose command line holds every one of `needles`; of a
        process and the children it forked (their command line is its own), the process."""
        assert self.stack.proc is not None
        found = descendants(self.stack.proc.pid)
        matching = [pid for pid in found if all(n in cmdline(pid) for n in needles)]
        forked = {kid for pid in matching for kid in descendants(pid)}
        return [pid for pid in matching if pid not in forked]

    def one(self, *needles: str) -> int:
        found = self.pids(*needles)
        assert len(found) == 1, f"{len(found)} processes run {needles}"
        return found[0]

    @staticmethod
    def broker_needles(node_id: int) -> tuple[str, str]:
        return ("kafka.Kafka", f"node-{node_id}/server.properties")

    def broker(self, node_id: int) -> int:
        return self.one(*self.broker_needles(node_id))

    def kill_broker(self, node_id: int, then: Callable[[], None] = lambda: None) -> None:
        """kill -9 of Kafka node `node_id`; `then` (while it is down); until the stack has
        started it again and it is back in every partition's in-sync replicas."""
        pid = self.broker(node_id)
        kill_tree(pid)
        then()
        self.restarted(pid, *self.broker_needles(node_id))
        self.back_in_sync(node_id)

    def spark_worker(self, n: int) -> int:
        return self.one("deploy.worker.Worker", f"worker-{n - 1}")

    API = ("-m stack.", " api ")  # `stack.cli api`, which execs itself as `stack.patched api`

    def api_node(self, port: int) -> int:
        return self.one(*self.API, f"--port {port}")

    def api_node_ready(self, port: int, timeout: float = 120) -> None:
        """Until the API node on `port` (started again) is ready and the balancer routes to
        it: it answers `/health` itself, and HAProxy's check has it `UP`."""
        wait_until(
            lambda: requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok,
            timeout,
            f"the API node on :{port} ready",
        )
        nodes = [self.stack.api_port + 1, self.stack.api_port + 2]
        balancer = LoadBalancer(self.stack.data_dir / "cluster" / "lb", self.stack.api_port, nodes)
        name = f"api{nodes.index(port) + 1}"

        def routed() -> bool:
            return balancer.servers().get(name, {}).get("status") == "UP"

        wait_until(routed, timeout, f"the balancer routing to {name} (:{port}) again")

    def processors(self) -> list[int]:
        return self.pids("stack.cli processor")

    def restarted(self, old: int, *needles: str, timeout: float = 120) -> int:
        """The process the stack started again in place of `old` (which it saw exit). Taken
        from the look that found it: a starting API process execs itself again, and a second
        look may come in between (it did, in CI)."""
        found: list[int] = []

        def again() -> bool:
            found[:] = [p for p in self.pids(*needles) if p != old]
            return bool(found)

        wait_until(again, timeout, f"{needles} again")
        return found[0]

    # ---- Kafka ----

    def brokers(self) -> list[str]:
        return self.settings.kafka().split(",")

    def address(self, node_id: int) -> str:
        """Where node `node_id` serves clients (its `advertised.listeners`)."""
        conf = self.stack.data_dir / "cluster" / "kafka" / f"node-{node_id}" / "server.properties"
        for line in conf.read_text().splitlines():
            if line.startswith("advertised.listeners="):
                return line.split("//", 1)[1].split(",", 1)[0]
        raise AssertionError(f"no advertised listener in {conf}")

    def _described(self, via: str | None = None) -> list[dict[str, Any]]:
        """The deployment's topics (and the group offsets'), as the cluster's metadata has
        them; with `via`, as that node's has them."""
        topics = Topics(self.settings.topic_prefix)
        bootstrap = [via] if via else self.brokers()
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=10_000, **kafka_client_options()
        )
        try:
            names = [t for t in admin.list_topics() if t.startswith(topics.prefix)]
            return list(admin.describe_topics([*names, "__consumer_offsets"]))
        finally:
            admin.close()

    def leader_of_most(self, *topics: str) -> int:
        """The node leading the most partitions of `topics` (the busiest: the load's)."""
        names = {Topics(self.settings.topic_prefix).events(t) for t in topics}
        leaders = Counter(
            p["leader"] for t in self._described() if t["topic"] in names for p in t["partitions"]
        )
        return leaders.most_common(1)[0][0]

    def active_controller(self) -> int:
        """The KRaft quorum's leader, as the nodes recorded it last (the newest epoch wins)."""
        latest: tuple[int, int] = (-1, -1)
        for state in (self.stack.data_dir / "cluster" / "kafka").glob(
            "node-*/log/__cluster_metadata-0/quorum-state"
        ):
            s = json.loads(state.read_text())
            if s.get("leaderId", -1) >= 0:
                latest = max(latest, (s["leaderEpoch"], s["leaderId"]))
        assert latest[1] > 0, "no node has recorded a quorum leader"
        return latest[1]

    def in_sync(self, via: str | None = None) -> bool:
        """Every partition of the deployment (and of the group offsets) on all three nodes."""
        described = self._described(via)
        short = [p for t in described for p in t["partitions"] if len(p["isr"]) < 3]
        return bool(described) and not short

    def serves(self, via: str) -> bool:
        try:
            return bool(self._described(via))
        except KafkaError:
            return False

    def back_in_sync(self, node: int, timeout: float = 180) -> None:
        """Until the restarted `node` is back in every partition's in-sync replicas. Asked
        through the node itself, once it serves requests: a KRaft broker back from an unclean
        stop serves only once the controller has unfenced it, which it does after taking the
        node out of every in-sync replica set; and the node's metadata is at least that new.
        (Waiting to see it out of them first, through any node, missed a short absence.)"""
        via = self.address(node)
        wait_until(lambda: self.serves(via), 120, f"Kafka node {node} serving again")
        wait_until(lambda: self.in_sync(via), timeout, "every partition back on three nodes")

    # ---- the views ----

    def caught_up(self, timeout: float = 180) -> None:
        caught_up(self.settings, timeout)

    def view_row(self, customer: str) -> dict[str, Any]:
        r = requests.get(
            f"{self.stack.base}/views/customers/{customer}", headers=self.auth, timeout=30
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def one_per_partition(self, run: str) -> list[str]:
        """Customers registered until one sits on each partition (from their answers'
        positions): what a freshness that covers every partition reads."""
        api = Clients([self.stack.base], self.token).api(self.stack.base)
        found: dict[int, str] = {}
        for i in range(16 * self.settings.partitions):
            if len(found) == self.settings.partitions:
                return list(found.values())
            a = api.command(
                "register-customer",
                {"name": f"fresh {run}", "email": f"{run}-{i}@example.com"},
                key=f"{run}-{i}",
            )
            assert a.status == 201, a.body
            partition = LogPosition.parse(a.body["position"]).partition
            found.setdefault(partition, a.body["aggregate_id"])
        raise AssertionError(f"no customer registered on some partitions: {sorted(found)}")

    def projector_modes(self) -> dict[str, str]:
        """Each query of the projector and its mode, as `/health` has them."""
        health = requests.get(f"{self.stack.base}/health", headers=self.auth, timeout=30)
        queries = health.json()["components"].get("projector", {}).get("queries", {})
        return {name: q.get("why", q["mode"]) for name, q in queries.items()}

    def freshness(self, customer: str, n: int, run: str) -> float:
        """Seconds from a command's `201` to the view including it (read with the position it
        answered), through the balancer."""
        api = Clients([self.stack.base], self.token).api(self.stack.base)
        answer = api.command(
            "change-customer-email",
            {"email": f"{run}-fresh-{n}@example.com"},
            aggregate_id=customer,
            key=f"{run}-fresh-{n}",
        )
        assert answer.status in (200, 201), answer.body
        started = time.monotonic()
        read = api.get(
            f"/views/customers/{customer}",
            params={"consistent_with": answer.body["position"], "wait": 30},
            headers=self.auth,
        )
        took = time.monotonic() - started
        return took if read.status_code == 200 else float("inf")


# ---- the load ----


class OpenLoop:
    """Commands at `rate` a second through the balancer, whatever their answers: registrations
    and email changes of the watched customers, each with an email of its own (what finds it in
    the log). Every other one has an Idempotency-Key and is sent again with it until answered;
    the others are sent once, and their answer is what the test holds the API to."""

    def __init__(self, cluster: Cluster, run: str, watched: list[str], rate: float = RATE):
        self.cluster, self.run, self.watched, self.rate = cluster, run, watched, rate
        self.clients = Clients([cluster.stack.base], cluster.token)
        self.sent: list[Logical] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="open-loop")
        self._futures: list[Future[None]] = []
        self._thread = threading.Thread(target=self._schedule, name="open-loop", daemon=True)
        self.give_up_at = time.monotonic() + GIVE_UP_S

    def __enter__(self) -> OpenLoop:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _schedule(self) -> None:
        started = time.monotonic()
        for i in range(10**9):
            if self._stop.wait(max(0.0, started + i / self.rate - time.monotonic())):
                return
            self.give_up_at = time.monotonic() + GIVE_UP_S
            cmd = self._command(i)
            self.sent.append(cmd)
            self._futures.append(self._pool.submit(self._send, cmd))

    def _command(self, i: int) -> Logical:
        email, key = f"{self.run}-{i}@example.com", f"{self.run}-{i}" if i % 2 == 0 else None
        if i % 4 < 2:
            data = {"name": f"{self.run} {i}", "email": email}
            return Logical(i, "register-customer", data, key=key)
        customer = self.watched[i % len(self.watched)]
        return Logical(i, "change-customer-email", {"email": email}, aggregate_id=customer, key=key)

    def _send(self, cmd: Logical) -> None:
        if cmd.key is None:
            cmd.attempts.append(send(self.clients.api(self.cluster.stack.base), cmd))
        else:
            until_answered(self.clients, cmd, 0, time.monotonic() + GIVE_UP_S, cmd.attempts)

    def wait_sent(self, n: int, timeout: float = 60) -> None:
        wait_until(lambda: len(self.sent) >= n, timeout, f"{n} commands sent")

    def stop(self, timeout: float = GIVE_UP_S + 60) -> None:
        self._stop.set()
        self._thread.join(10)
        done, pending = wait(self._futures, timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        assert not pending, f"{len(pending)} commands still unanswered after {timeout:.0f} s"
        for future in done:
            future.result()


class VersionsNotDense(AssertionError):
    """A customer's versions in the log have a gap or a duplicate (guarantee 2). `around`: per
    partition of the customers' topic, the first and last offset of those customers' records;
    `aggregates`: those customers."""

    def __init__(
        self, said: list[str], around: dict[int, tuple[int, int]], aggregates: set[str]
    ) -> None:
        super().__init__(said)
        self.around, self.aggregates = around, aggregates


def where_versions_are(
    settings: Settings, log: list[Any]
) -> tuple[list[str], dict[int, tuple[int, int]], set[str]]:
    """For each aggregate whose versions are not dense: every record of it in the topic, read
    uncommitted, with its partition and offset, and whether a committed read sees it. Says
    whether a missing version was written and aborted, or never written (or lost). Also: per
    partition, the first and last offset of those records (`VersionsNotDense.around`), and
    those aggregates."""
    dense: dict[str, list[int]] = defaultdict(list)
    for e in log:
        dense[e.aggregate_id].append(e.version)
    broken = {a for a, vs in dense.items() if sorted(vs) != list(range(1, len(vs) + 1))}
    topic = Topics(settings.topic_prefix).events("customer")
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        isolation_level="read_uncommitted",
        enable_auto_commit=False,
        **kafka_consumer_options(),
    )
    found: dict[str, list[str]] = defaultdict(list)
    offsets: dict[int, list[int]] = defaultdict(list)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                for r in records:
                    agg, _, version = (r.key or b"").decode().rpartition(":")
                    if agg in broken:
                        seen = "committed" if int(version) in dense[agg] else "NOT COMMITTED"
                        found[agg].append(f"v{version}@{r.partition}:{r.offset} {seen}")
                        offsets[r.partition].append(r.offset)
    finally:
        consumer.close()
    said = [f"{agg} in the topic: {', '.join(found[agg])}" for agg in sorted(broken)]
    return said, {p: (min(os), max(os)) for p, os in offsets.items()}, broken


BATCH = re.compile(r"^baseOffset: (\d+) lastOffset: (\d+) ")
RECORD = re.compile(r"^\| offset: (\d+) ")


def log_batches(
    kafka_dir: Path, topic: str, around: dict[int, tuple[int, int]], margin: int = 20
) -> list[str]:
    """What each Kafka node under `kafka_dir` (`node-<id>/log`) holds of `topic` around those
    offsets, read from its files by the broker's own DumpLogSegments: each batch's producer id
    and epoch, transactional or not, and each control record's COMMIT or ABORT marker. Says
    whether a record a committed read does not see was aborted, or committed and not read,
    and whether the nodes agree."""
    said = []
    for partition, (first, last) in sorted(around.items()):
        low, high = first - margin, last + margin
        for node, lines in _dumps(kafka_dir, topic, partition):
            said.append(f"--- {node}, {topic}-{partition}, offsets {low}..{high}:")
            for line in lines:
                batch, record = BATCH.match(line), RECORD.match(line)
                span = (int(batch[1]), int(batch[2])) if batch else None
                if record:
                    span = (int(record[1]), int(record[1]))
                if span is not None and span[1] >= low and span[0] <= high:
                    said.append(line[:240])
    return said


def keyed_records(
    kafka_dir: Path, topic: str, partitions: Iterable[int], keys: Iterable[str]
) -> list[str]:
    """Each node's records of `topic` whose key is one of `keys` (a snapshot's
    `customer:<id>`, with its version), each after its batch's line (producer id and epoch,
    to match with the events' batches that `log_batches` shows) and before the marker that
    ended its transaction (the partition's one writer's next COMMIT or ABORT)."""
    wanted = [f"key: {k} " for k in keys]
    said = []
    for partition in sorted(set(partitions)):
        for node, lines in _dumps(kafka_dir, topic, partition):
            said.append(f"--- {node}, {topic}-{partition}, records of {len(wanted)} keys:")
            batch, ended = "", True
            for line in lines:
                if BATCH.match(line):
                    batch = line
                elif not RECORD.match(line):
                    continue
                elif any(w in line for w in wanted):
                    said += [batch[:240], line[:400]]
                    ended = False
                elif "endTxnMarker" in line and not ended:
                    said.append(line[:240])
                    ended = True
    return said


def _dumps(kafka_dir: Path, topic: str, partition: int) -> Iterator[tuple[str, list[str]]]:
    """Each node's name and the lines DumpLogSegments prints of its files of that partition."""
    for node in sorted(kafka_dir.glob("node-*")):
        files = sorted((node / "log" / f"{topic}-{partition}").glob("*.log"))
        if not files:
            continue
        jars = f"{REPO / '.stack' / 'lib' / 'kafka'}/*"
        dump = ["kafka.tools.DumpLogSegments", "--print-data-log", "--files"]
        out = subprocess.run(
            ["java", "-cp", jars, *dump, ",".join(str(f) for f in files)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        yield node.name, out.stdout.splitlines()


def check_commands(settings: Settings, run: str, sent: list[Logical]) -> str:
    """Every command with a key got a `201` (or its replay) and is in the log once; one without
    is in the log once if answered `201`, never if answered `503` or a `4xx`, at most once if
    answered `504`, `502` (`node_lost`) or not at all (API.md); the versions of the run's
    customers stay dense. Returns the answers counted."""
    everything = log_of(settings, "customer")
    ours = {e.aggregate_id for e in everything if e.data.get("email", "").startswith(f"{run}-")}
    log = [e for e in everything if e.aggregate_id in ours]
    if problems := version_problems(log):
        said, around, broken = where_versions_are(settings, log)
        raise VersionsNotDense(problems[:10] + said, around, broken)
    by_email: dict[str, list[Any]] = defaultdict(list)
    for e in log:
        if "email" in e.data:
            by_email[e.data["email"]].append(e)
    problems = []
    for cmd in sent:
        final, found = cmd.final, len(by_email.get(cmd.data["email"], []))
        status = final.status if final is not None else None
        if status in (200, 201):
            allowed = (1, 1)
        elif status in (None, 502, 504):  # no outcome: applied or not, never twice
            # (502: the balancer's `node_lost`, the node died before it answered: API.md)
            allowed = (0, 1)
        else:  # 503 (nothing written), a 4xx
            allowed = (0, 0)
        if cmd.key is not None and not cmd.committed:
            problems.append(f"a command with a key was never applied: {cmd.describe()}")
        elif not allowed[0] <= found <= allowed[1]:
            problems.append(f"answered {status}, in the log {found}x: {cmd.describe()}")
    bodies = [c.final.body for c in sent if c.committed and c.final is not None]
    problems += committed_problems(log, bodies)
    counts = status_counts(sent)
    assert not problems, f"{len(problems)} problems ({dict(counts)}):\n" + "\n".join(problems[:20])
    return ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))


# ---- websocket clients ----


class Follower:
    """A websocket client of `customers` rows named `name`, through the balancer. When its
    connection drops (its node killed, or draining) it connects again through the balancer and
    resumes with `since`, as a client of the API should; it keeps every message it got."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.url = cluster.stack.base.replace("http://", "ws://") + "/ws"
        self.token, self.name = cluster.token, name
        self.earlier: list[dict[str, Any]] = []
        self.resumed = 0
        self.client = self._connect(None)
        self._taken: WsClient | None = None  # a closed connection whose messages are earlier's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _connect(self, since: str | None) -> WsClient:
        client = WsClient(self.url, self.token)
        client.subscribe("s", "customers", {"name": self.name}, since=since)
        return client

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if self.client.close_code is None:
                continue
            # The closed connection's messages, taken once (however many tries the next
            # connection takes).
            self.earlier += self.client.of("s")
            self._taken = self.client
            since = next((m["position"] for m in reversed(self.earlier) if "position" in m), None)
            while not self._stop.is_set():
                try:
                    self.client = self._connect(since)
                    self.resumed += 1
                    break
                except (websocket.WebSocketException, OSError):
                    self._stop.wait(0.1)  # the balancer has no node up this instant

    def messages(self) -> list[dict[str, Any]]:
        client = self.client
        return self.earlier + (client.of("s") if client is not self._taken else [])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


def check_followers(settings: Settings, followers: list[Follower], keys: list[str]) -> None:
    """Each follower, over all its connections, holds the watched rows as the table has them,
    got each change of the changelog once and in order, and was never sent a snapshot again
    (it resumed)."""
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT customer_id, email, version FROM customers WHERE customer_id = ANY(%s)", (keys,)
        )
        table = {r[0]: (r[1], r[2]) for r in rows}
    logged: dict[str, list[int]] = defaultdict(list)
    for change in distinct(changelog(settings, "customers")):
        if change.row is not None and change.key["customer_id"] in table:
            logged[change.key["customer_id"]].append(change.row["version"])

    def holds_the_table(f: Follower) -> bool:
        rows = fold(f.messages(), "customer_id")
        return {k: (r["email"], r["version"]) for k, r in rows.items()} == table

    for f in followers:
        wait_until(lambda f=f: holds_the_table(f), 120, "a follower to hold the table's rows")
        messages = f.messages()
        assert [m["type"] for m in messages].count("snapshot") == 1, "it did not resume"
        assert not [m for m in messages if m["type"] in ("resync", "error")], messages[-3:]
        seen: dict[str, list[int]] = defaultdict(list)
        for m in messages:
            if m["type"] == "change" and m["op"] == "upsert":
                seen[m["key"]["customer_id"]].append(m["row"]["version"])
        for key, versions in seen.items():
            assert logged[key][-len(versions) :] == versions, (key, versions, logged[key])


@contextmanager
def followed(cluster: Cluster, name: str, clients: int = 2) -> Iterator[list[Follower]]:
    followers = [Follower(cluster, name) for _ in range(clients)]
    try:
        for f in followers:
            wait_until(lambda f=f: bool(f.client.of("s", "snapshot")), 30, "a snapshot")
        yield followers
    finally:
        for f in followers:
            f.close()


@dataclass
class Watched:
    """Customers registered for a test, all named alike: what its followers subscribe to."""

    name: str
    ids: list[str] = field(default_factory=list)

    @classmethod
    def register(cls, cluster: Cluster, run: str, count: int = WATCHED) -> Watched:
        api = Clients([cluster.stack.base], cluster.token).api(cluster.stack.base)
        watched = cls(f"watched {run}")
        for i in range(count):
            a = api.command(
                "register-customer",
                {"name": watched.name, "email": f"{run}-watched-{i}@example.com"},
                key=f"{run}-watched-{i}",
            )
            assert a.status == 201, a.body
            watched.ids.append(a.body["aggregate_id"])
        return watched
