"""Every kafka-python consumer Logfold makes takes the fetch bounds of `kafka_fetch_bounds`
(config/settings.py): without them, a fetch response larger than the client's frame bound closes
its connection (tests/integration/test_fetch_bounds.py shows that it happens, and that the
bounds prevent it)."""

from __future__ import annotations

import ast
from pathlib import Path

from config.settings import KAFKA_MAX_BATCH_BYTES, kafka_fetch_bounds

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "bench", "cdc", "commands", "events", "projections", "spark", "stack", "streams")


def consumers_without_bounds() -> list[str]:
    """Where a `KafkaConsumer(...)` is made without `**kafka_fetch_bounds()`."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and _named(node.func, "KafkaConsumer")):
                    continue
                spread = [k.value for k in node.keywords if k.arg is None]
                if not any(
                    isinstance(v, ast.Call) and _named(v.func, "kafka_fetch_bounds") for v in spread
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _named(func: ast.expr, name: str) -> bool:
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def test_every_consumer_takes_the_fetch_bounds() -> None:
    assert consumers_without_bounds() == []


def test_the_frame_bound_is_above_any_fetch_response() -> None:
    bounds = kafka_fetch_bounds()
    largest_records = max(bounds["fetch_max_bytes"], KAFKA_MAX_BATCH_BYTES)
    assert bounds["receive_message_max_bytes"] > largest_records
    assert bounds["max_partition_fetch_bytes"] >= KAFKA_MAX_BATCH_BYTES
