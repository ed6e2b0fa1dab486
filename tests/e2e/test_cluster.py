"""`logfold run --cluster` (the README's `make cluster`): three Kafka nodes, a Spark standalone
master with two workers running the projector, two command processors, two API nodes behind
HAProxy, started by the one command on local ports, serving the README's requests through the
balancer, and stopped by Ctrl-C."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from kafka.admin import KafkaAdminClient

from stack.procs import port_open, wait_until
from tests.e2e.test_local_stack import RunningStack

START_S = 480  # three brokers, Spark, and the projector's warm-up, on a slow machine

# The fixture's start counts against its first test's timeout: past START_S, the stack's
# last lines are shown, not pytest-timeout's stack of the wait.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(START_S + 240)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RunningStack, str]]:
    # Outside pytest's private folder: Postgres runs as another user (as test_local_stack's).
    top = Path(tempfile.mkdtemp(prefix="logfold-cluster-"))
    top.chmod(0o755)
    running = RunningStack(top / "data", "--cluster")
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

    health = requests.get(f"{stack.base}/health", headers=auth, timeout=30).json()["components"]
    assert health["kafka"]["brokers"] == 3, health["kafka"]
    assert health["command_processing"]["processors"] == 2, health["command_processing"]
    projector = health["projector"]
    assert projector["master"].startswith("spark://"), projector
    assert projector["executors"] == 2 and projector["slots"] >= projector["slots_needed"]
    assert {q["mode"] for q in projector["queries"].values()} == {"real-time"}, projector

    brokers = [f"127.0.0.1:{stack.kafka_port + 2 * i}" for i in range(3)]
    admin = KafkaAdminClient(bootstrap_servers=",".join(brokers))
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


def test_ctrl_c_stops_the_whole_cluster(cluster: tuple[RunningStack, str]) -> None:
    stack, _ = cluster
    assert stack.interrupt() == 0, stack.tail()
    stopped = "".join(stack.output[stack.interrupted_at :])
    for line in ("stopped api-1", "stopped api-2", "stopped the load balancer", "stopped Spark"):
        assert line in stopped, stopped
    ports = [stack.api_port, stack.api_port + 1, stack.api_port + 2, stack.pg_port]
    ports += [stack.kafka_port + 2 * i for i in range(3)]
    wait_until(lambda: not any(port_open(p) for p in ports), 30, "every port closed")
