"""`logfold run --cluster` (the README's `make cluster`): three Kafka nodes, a Spark standalone
master with two workers running the projector, two command processors, two API nodes behind
HAProxy, started by the one command on local ports, serving the README's requests through the
balancer, and stopped by Ctrl-C.

Between the first test and the last, faults on that one cluster, each under open-loop commands
and websocket clients through the balancer (guarantee 28): kill -9 of the broker leading the
busiest partitions, of the active controller, of a Spark worker, of an API node and of a command
processor, and a broker hung (SIGSTOP) until the controller fenced it. The stack starts again
what was killed, as it would in production (tests/e2e/faults.py has the load and the checks)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from kafka.admin import KafkaAdminClient

from config.settings import kafka_client_options
from config.topics import Topics
from stack.procs import port_open, wait_until
from tests.e2e.faults import (
    RATE,
    Cluster,
    OpenLoop,
    VersionsNotDense,
    Watched,
    check_commands,
    check_followers,
    followed,
    keyed_records,
    log_batches,
)
from tests.e2e.test_local_stack import RunningStack
from tests.oracle import differences
from tests.support import kill_tree

START_S = 480  # three brokers, Spark's master and workers, and the projector, on a slow machine

# The fixture's start counts against its first test's timeout: past START_S, the stack's
# last lines are shown, not pytest-timeout's stack of the wait.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(START_S + 240)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RunningStack, str]]:
    # Outside pytest's private folder: Postgres runs as another user (as test_local_stack's).
    top = Path(tempfile.mkdtemp(prefix="logfold-cluster-"))
    top.chmod(0o755)
    running = RunningStack(top / "data", "--cluster")
    # No warm-up (19-29 s on this cluster; the README flow's stack keeps it): the projector's
    # session waits for an executor before it counts the slots real-time mode needs. Nor a
    # rebuild rehearsal, which would share the cores with the first fault test's load.
    running.env["LOGFOLD_PROJECTOR_WARM_UP_ROUNDS"] = "0"
    running.env["LOGFOLD_PROJECTOR_REBUILD_REHEARSAL_RECORDS"] = "0"
    try:
        token = running.start(timeout=START_S)
        yield running, token
    finally:
        running.kill()
        shutil.rmtree(top, ignore_errors=True)


def test_the_cluster_starts_with_one_command_and_serves_through_the_balancer(
    cluster: tuple[RunningStack, str],
) -> None:
    stack, token = cluster
    auth = {"Authorization": f"Bearer {token}"}
    banner = "".join(stack.output)
    nodes = [stack.api_port + 1, stack.api_port + 2]
    assert f"API nodes  :{nodes[0]}, :{nodes[1]} behind HAProxy on :{stack.api_port}" in banner
    for port in nodes:  # each node answers on its own port too
        assert requests.get(f"http://127.0.0.1:{port}/health/live", timeout=10).ok

    def health() -> dict[str, Any]:
        got = requests.get(f"{stack.base}/health", headers=auth, timeout=30)
        components: dict[str, Any] = got.json()["components"]
        return components

    def whole(projector: dict[str, Any]) -> bool:
        return (
            projector.get("executors") == 2
            and projector["slots"] >= projector["slots_needed"]
            and {q["mode"] for q in projector["queries"].values()} == {"real-time"}
        )

    first = health()
    assert first["kafka"]["brokers"] == 3, first["kafka"]
    assert first["command_processing"]["processors"] == 2, first["command_processing"]
    assert first["projector"]["master"].startswith("spark://"), first["projector"]
    # The second worker's executor may register seconds after the first under load; the
    # projector then goes to real-time mode by itself (SLOTS_LOOK_S), and its status says so.
    try:
        wait_until(
            lambda: whole(health()["projector"]), 60, "both executors, in real-time mode", 1.0
        )
    except TimeoutError as e:
        raise AssertionError(f"{e}: {health()['projector']}") from e

    brokers = [f"127.0.0.1:{stack.kafka_port + 2 * i}" for i in range(3)]
    admin = KafkaAdminClient(bootstrap_servers=",".join(brokers), **kafka_client_options())
    try:
        described = admin.describe_topics(["events.customer", "__consumer_offsets"])
    finally:
        admin.close()
    for topic in described:
        assert {len(p["replicas"]) for p in topic["partitions"]} == {3}, topic["topic"]

    posted = requests.post(
        f"{stack.base}/commands/register-customer",
        json={"data": {"name": "Ada", "email": "ada@example.com"}},
        headers=auth,
        timeout=30,
    )
    assert posted.status_code == 201, posted.text
    body = posted.json()
    row = requests.get(
        f"{stack.base}/views/customers/{body['aggregate_id']}",
        params={"consistent_with": body["position"], "wait": 30},
        headers=auth,
        timeout=60,
    )
    assert row.status_code == 200 and row.json()["name"] == "Ada", row.text


# ---- faults under load (guarantee 28): each test injects one while commands flow open-loop
# through the balancer and two websocket clients follow a view through it; once the fault is
# over, every answer's promise holds in the log, every view equals the independent fold of the
# log, and each client got every change once, in order. ----

SETTLE = 4 * RATE  # commands sent before the fault and again after it

# A version gap in the log (two consecutive versions missing, later ones present) was seen now
# and then after a broker fault, until a processor defect was fixed (a send that failed alone
# no longer lets its transaction commit). Should it show again, the test fails with where each
# version of those customers is: in the topic (written and aborted, or never there), in each
# Kafka node's files, in their snapshots, and what the processors said. See
# docs/operations.md ("A version gap after a broker fault").


@pytest.fixture(scope="module")
def faults(cluster: tuple[RunningStack, str]) -> Cluster:
    return Cluster(*cluster)


class Laps:
    """How long each phase took since the one before it (the first: since it was made)."""

    def __init__(self) -> None:
        self.took: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.took[phase], self._last = now - self._last, now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.0f} s" for k, v in self.took.items())


def under_load(cluster: Cluster, inject: Callable[[], str]) -> list[int]:
    """Run `inject` under load; check what followed. Returns how often each client resumed."""
    run = f"f{uuid.uuid4().hex[:6]}"
    watched = Watched.register(cluster, run)
    with followed(cluster, watched.name) as followers:
        with OpenLoop(cluster, run, watched.ids) as load:
            load.wait_sent(SETTLE)
            lap = Laps()
            what = inject()
            load.wait_sent(len(load.sent) + SETTLE)
        lap("fault")
        try:
            answers = check_commands(cluster.settings, run, load.sent)
            lap("log")
            cluster.caught_up()
            lap("catch-up")
            assert differences(cluster.settings) == {}
            lap("fold")
            check_followers(cluster.settings, followers, watched.ids)
            lap("followers")
        except VersionsNotDense as e:
            said = [ln for ln in cluster.stack.output if ln.startswith("processor")]
            topics = Topics(cluster.settings.topic_prefix)
            kafka = cluster.stack.data_dir / "cluster" / "kafka"
            held = log_batches(kafka, topics.events("customer"), e.around)
            # Their snapshots, in the same partitions: a snapshot committed past the events
            # (or one whose transaction's events were aborted) shows there.
            keys = [f"customer:{a}" for a in sorted(e.aggregates)]
            snapshots = keyed_records(kafka, topics.snapshots, e.around, keys)
            raise AssertionError(
                f"{e}\n--- what the processors said:\n{''.join(said[-60:])}"
                "--- what each Kafka node holds there:\n"
                + "\n".join(held)
                + "\n--- their snapshots on each node:\n"
                + "\n".join(snapshots)
            ) from e
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- the stack's last lines:\n{cluster.stack.tail()}") from e
        resumed = [f.resumed for f in followers]
    print(f"\n{what}; {len(load.sent)} commands ({answers}); clients resumed {resumed} times")
    print(f"(time: {lap})")
    return resumed


def test_kill_9_of_the_leader_of_the_busiest_partitions(faults: Cluster) -> None:
    def inject() -> str:
        node = faults.leader_of_most("customer")
        faults.kill_broker(node)
        return f"kill -9 of Kafka node {node} (leader of the most customer partitions)"

    under_load(faults, inject)


def test_kill_9_of_the_active_controller(faults: Cluster) -> None:
    def inject() -> str:
        node = faults.active_controller()

        def new_leader() -> None:
            wait_until(lambda: faults.active_controller() != node, 60, "another quorum leader")

        faults.kill_broker(node, then=new_leader)
        return f"kill -9 of Kafka node {node}, the active controller"

    under_load(faults, inject)


def test_a_broker_hung_past_its_session_timeout_then_resumed(faults: Cluster) -> None:
    """SIGSTOP: a node that does not answer, not a dead one (no restart); SIGCONT once the
    controller has fenced it and moved its partitions' leadership away."""

    def inject() -> str:
        node = faults.leader_of_most("customer")
        pid = faults.broker(node)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: faults.leader_of_most("customer") != node, 90, "leaders moved away")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(faults.in_sync, 180, "every partition back on three nodes")
        return f"SIGSTOP of Kafka node {node} until fenced, then SIGCONT"

    under_load(faults, inject)


FRESHNESS_BOUND_S = 180  # from kill -9 of a Spark worker to views as fresh as before it


def test_kill_9_of_a_spark_worker(faults: Cluster) -> None:
    def inject() -> str:
        customers = faults.one_per_partition(f"w{uuid.uuid4().hex[:6]}")

        def freshness(n: int, run: str) -> float:  # the slowest partition's
            return max(faults.freshness(c, n, f"{run}{i}") for i, c in enumerate(customers))

        before = sorted(freshness(n, "before") for n in range(5))
        normal = max(before[-1] * 2, 1.0)  # the normal p99, with room for this VM's noise
        pid = faults.spark_worker(1)
        kill_tree(pid)  # the worker and its executor
        killed = time.monotonic()
        faults.restarted(pid, "deploy.worker.Worker", "worker-0")
        streak: list[float] = []

        def fresh_again() -> bool:
            took = freshness(len(streak) + 5, "after")
            streak.append(took)
            return len(streak) >= 3 and all(t <= normal for t in streak[-3:])

        try:
            wait_until(fresh_again, FRESHNESS_BOUND_S, f"reads as fresh as before ({normal:.2f} s)")
        except TimeoutError as e:
            said = [ln for ln in faults.stack.output if ln.startswith("projector")]
            raise AssertionError(
                f"{e}; freshness since the kill (s): {[round(t, 2) for t in streak]}\n"
                f"--- the projector's modes: {faults.projector_modes()}\n"
                f"--- what the projector said:\n{''.join(said[-40:])}"
            ) from e
        return (
            f"kill -9 of Spark worker 1: freshness {before[-1]:.2f} s before, back under "
            f"{normal:.2f} s {time.monotonic() - killed:.0f} s after the kill "
            f"(projector: {faults.projector_modes()})"
        )

    under_load(faults, inject)


def test_kill_9_of_an_api_node(faults: Cluster) -> None:
    """Each node in turn, the second once the first is back behind the balancer: whichever
    node a client's socket went to (the balancer picks the one with the fewest connections,
    and connections the tests before left open count), it lost its node, connected again
    through the balancer and resumed."""

    def inject() -> str:
        nodes = [faults.stack.api_port + 1, faults.stack.api_port + 2]
        for port in nodes:
            pid = faults.api_node(port)
            kill_tree(pid)  # gunicorn's master and its worker
            faults.restarted(pid, *faults.API, f"--port {port}")
            faults.api_node_ready(port)
        return f"kill -9 of API node :{nodes[0]}, then of :{nodes[1]} once the first was back"

    resumed = under_load(faults, inject)
    assert resumed and all(n >= 1 for n in resumed), resumed


def test_kill_9_of_a_command_processor(faults: Cluster) -> None:
    def inject() -> str:
        pid = faults.processors()[0]
        kill_tree(pid)
        wait_until(lambda: len(faults.processors()) == 2, 60, "the processor started again")
        return "kill -9 of a command processor"

    under_load(faults, inject)


def test_ctrl_c_stops_the_whole_cluster(cluster: tuple[RunningStack, str]) -> None:
    stack, _ = cluster
    assert stack.interrupt() == 0, stack.tail()
    stopped = "".join(stack.output[stack.interrupted_at :])
    for line in ("stopped api-1", "stopped api-2", "stopped the load balancer", "stopped Spark"):
        assert line in stopped, stopped
    ports = [stack.api_port, stack.api_port + 1, stack.api_port + 2, stack.pg_port]
    ports += [stack.kafka_port + 2 * i for i in range(3)]
    wait_until(lambda: not any(port_open(p) for p in ports), 30, "every port closed")
