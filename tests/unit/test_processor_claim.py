"""A partition's claim with Kafka away: every wait of the processor on Kafka is bounded
(guarantee 28), so that it starts its session over, and stops when asked, instead of waiting
for Kafka's return."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaTimeoutError

import commands.processor
from commands.processor import CommandProcessor
from config.settings import Settings
from stack.procs import free_port


def test_a_claim_without_a_resume_point_asks_the_group_within_the_kafka_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition with no resume point of its own (a new deployment's) asks the group for
    its committed offset; with nothing listening where Kafka should be, that ends at a Kafka
    request's timeout (made short here)."""
    nowhere = f"127.0.0.1:{free_port()}"
    processor = CommandProcessor(Settings(kafka_bootstrap_servers=nowhere, jwt_secret="x" * 32))
    monkeypatch.setattr(commands.processor, "KAFKA_REQUEST_TIMEOUT_MS", 500)
    # The partition's writer, made without Kafka: it has no resume point.
    monkeypatch.setattr(
        commands.processor, "PartitionOwner", lambda *_: SimpleNamespace(resume_at=None)
    )
    consumer = KafkaConsumer(
        bootstrap_servers=nowhere, group_id="claims", api_version=(2, 8), metrics_enabled=False
    )
    tp = TopicPartition(processor.topics.commands, 0)
    consumer.assign([tp])
    processor._claims.append(tp)
    outcome: list[Any] = []

    def claim() -> None:
        try:
            processor._claim(consumer)
            outcome.append("claimed")
        except Exception as e:
            outcome.append(e)

    claiming = threading.Thread(target=claim, daemon=True)
    claiming.start()
    claiming.join(60)
    assert not claiming.is_alive(), "the claim still waits for the group's coordinator"
    consumer.close()
    assert isinstance(outcome[0], KafkaTimeoutError), outcome
