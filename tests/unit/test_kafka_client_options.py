"""Every kafka-python client Logfold makes takes the options of config/settings.py: consumers
`**kafka_consumer_options()` (the connection settings and the fetch bounds), producers and admin
clients `**kafka_client_options()`. Without the fetch bounds, a fetch response larger than the
client's frame bound closes its connection (tests/integration/test_fetch_bounds.py shows that it
happens, and that the bounds prevent it); without the connection settings, a client finds a
broker that came back up to 30 s late."""

from __future__ import annotations

import ast
from pathlib import Path

from config.settings import (
    KAFKA_MAX_BATCH_BYTES,
    kafka_client_options,
    kafka_consumer_options,
    kafka_fetch_bounds,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "app",
    "bench",
    "cdc",
    "commands",
    "config",
    "events",
    "projections",
    "spark",
    "stack",
    "streams",
    "webhooks",
)
# What each kind of client must be given, spread as `**options()`.
OPTIONS = {
    "KafkaConsumer": "kafka_consumer_options",
    "KafkaProducer": "kafka_client_options",
    "KafkaAdminClient": "kafka_client_options",
}


def clients_without_options() -> list[str]:
    """Where a kafka-python client is made without the options its kind takes."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                kind = next((k for k in OPTIONS if _named(node.func, k)), None)
                if kind is None:
                    continue
                spread = [k.value for k in node.keywords if k.arg is None]
                if not any(
                    isinstance(v, ast.Call) and _named(v.func, OPTIONS[kind]) for v in spread
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {kind}")
    return found


def _named(func: ast.expr, name: str) -> bool:
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def test_every_client_takes_its_options() -> None:
    assert clients_without_options() == []


def test_a_consumer_takes_the_connection_settings_and_the_fetch_bounds() -> None:
    assert kafka_consumer_options() == {**kafka_client_options(), **kafka_fetch_bounds()}


def test_a_lost_broker_is_tried_again_within_a_second() -> None:
    options = kafka_client_options()
    assert 0 < options["reconnect_backoff_ms"] <= options["reconnect_backoff_max_ms"] <= 1000


def test_the_frame_bound_is_above_any_fetch_response() -> None:
    bounds = kafka_fetch_bounds()
    largest_records = max(bounds["fetch_max_bytes"], KAFKA_MAX_BATCH_BYTES)
    assert bounds["receive_message_max_bytes"] > largest_records
    assert bounds["max_partition_fetch_bytes"] >= KAFKA_MAX_BATCH_BYTES
