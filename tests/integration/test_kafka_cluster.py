"""Three KRaft nodes on this machine (`stack.local_kafka.KafkaCluster`, as the cluster topology
starts them): every topic, the internal ones too, on three nodes with `min.insync.replicas=2`;
an idempotent `acks=all` producer writing while the leader of its partition is killed with
`kill -9` loses nothing and doubles nothing, and the killed node rejoins when it comes back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from stack.local_kafka import KafkaCluster
from stack.procs import free_port, wait_until
from tests.support import REPO

pytestmark = pytest.mark.integration

TOPIC = "cluster-check"


@pytest.fixture(scope="module")
def cluster(workdir: Path) -> Iterator[KafkaCluster]:
    nodes = KafkaCluster(
        REPO / ".stack" / "lib",
        workdir / "kafka-cluster",
        [(free_port(), free_port()) for _ in range(3)],
    )
    nodes.start()
    yield nodes
    nodes.stop()


def _partition(admin: KafkaAdminClient, topic: str) -> dict[str, Any]:
    (described,) = admin.describe_topics([topic])
    (partition,) = described["partitions"]
    return dict(partition)


def test_a_new_topic_has_three_copies_in_sync(
    cluster: KafkaCluster,
) -> None:
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    try:
        admin.create_topics([NewTopic(TOPIC, 1)])  # the cluster's defaults
        wait_until(lambda: len(_partition(admin, TOPIC)["isr"]) == 3, 60, "three copies in sync")
        assert len(_partition(admin, TOPIC)["replicas"]) == 3
    finally:
        admin.close()


def test_an_acks_all_producer_loses_and_doubles_nothing_when_the_leader_is_killed(
    cluster: KafkaCluster,
) -> None:
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    leader = int(_partition(admin, TOPIC)["leader"])
    producer = KafkaProducer(
        bootstrap_servers=cluster.bootstrap,
        acks="all",
        enable_idempotence=True,
        retries=1_000_000,
        delivery_timeout_ms=120_000,
        request_timeout_ms=10_000,
    )
    acknowledged: list[int] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set() or i < 2000:
            future = producer.send(TOPIC, str(i).encode(), partition=0)
            future.add_callback(lambda _, n=i: acknowledged.append(n))
            future.add_errback(failed.append)
            i += 1
            if i % 100 == 0:
                producer.flush()

    writer = threading.Thread(target=produce, daemon=True)
    writer.start()
    wait_until(lambda: len(acknowledged) >= 500, 60, "the first acknowledged records")
    cluster.node(leader).kill()  # mid-stream
    wait_until(
        lambda: int(_partition(admin, TOPIC)["leader"]) not in (leader, -1),
        60,
        "a new leader",
    )
    stop.set()
    writer.join(timeout=180)
    assert not writer.is_alive(), "the producer did not finish"
    producer.flush(timeout=120)
    producer.close(timeout=30)
    assert not failed, failed[:3]

    consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap, enable_auto_commit=False)
    tp = TopicPartition(TOPIC, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    end = consumer.end_offsets([tp])[tp]
    read: list[int] = []
    while consumer.position(tp) < end:
        for records in consumer.poll(timeout_ms=1000).values():
            read += [int(r.value) for r in records]
    consumer.close()
    assert read == sorted(acknowledged) == list(range(len(read)))  # once each, in order

    cluster.node(leader).start()  # back from its own data directory: in sync again
    wait_until(
        lambda: leader in _partition(admin, TOPIC)["isr"],
        120,
        "the killed node back in sync",
    )
    admin.close()
