"""Spark's decoding of the stored events: the envelope and the fields of `data` in one pass
(`spark.decode`), giving the projections what the JSON says."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, get_type_hints

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import ArrayType, DoubleType, LongType, StringType, StructType

from events.catalog import EVENT_TYPES
from events.order import PlacedLine
from events.serialization import dumps, encode, envelope_for, to_data
from projections.base.rows import PAID_LINE
from spark.decode import DATA, _field_type, every_event, parse_events
from streams.ingest import FactRecord
from tests.unit.test_serialization import SAMPLES, stored

pytestmark = pytest.mark.spark


def records(spark: SparkSession, values: list[bytes], topics: list[str] | None = None) -> Any:
    """Kafka records of `values`, of topic "events.any" unless `topics` names each one's."""
    now = datetime.now(UTC).replace(tzinfo=None)
    names = topics or ["events.any"] * len(values)
    rows = [(v, t, 0, i, now) for i, (v, t) in enumerate(zip(values, names, strict=True))]
    return spark.createDataFrame(
        rows, "value binary, topic string, partition int, offset long, timestamp timestamp"
    )


def as_text(value: Any) -> str | None:
    """What a top-level scalar of `data` decodes to: its JSON text, a string's own text."""
    return value if isinstance(value, str) or value is None else json.dumps(value)


def stored_event(event: Any, event_id: str) -> bytes:
    """`event` as the write side stores it."""
    return encode(
        envelope_for(
            event,
            event_id=event_id,
            aggregate_type="any",
            aggregate_id="a",
            version=1,
            occurred_at="2026-11-25T10:00:00Z",
            command_id="c",
            correlation_id="c",
            causation_id="c",
        )
    )


def test_every_event_types_data_decodes_to_what_its_json_says(spark: SparkSession) -> None:
    assert {type(e) for e in SAMPLES} == set(EVENT_TYPES.values())
    values = [stored_event(e, f"e{i}") for i, e in enumerate(SAMPLES)]
    decoded = every_event(parse_events(records(spark, values))).collect()
    assert len(decoded) == len(SAMPLES)
    for event, row in zip(SAMPLES, decoded, strict=True):
        assert row["current"] and row["type"] == event.type_name()
        data = row["data"].asDict(recursive=True)
        expected = to_data(event)
        for name, value in expected.items():
            if isinstance(value, list):  # an order's lines: typed, as `PAID_LINE`
                assert data[name] == value
            else:
                assert data[name] == as_text(value), name
        # The other types' fields are absent, not made up.
        assert all(v is None for k, v in data.items() if k not in expected)


def test_an_order_line_decodes_as_the_views_read_it() -> None:
    assert DATA["lines"].dataType == ArrayType(PAID_LINE)


def test_a_record_at_an_older_schema_version_is_left_to_the_upcasters(
    spark: SparkSession,
) -> None:
    old = stored("CustomerRegistered", 1, {"full_name": "Ann Lee", "email": "ann@example.com"})
    [row] = every_event(parse_events(records(spark, [old]))).collect()
    assert row["current"] is False


def test_a_fields_type_follows_its_declaration() -> None:
    @dataclass
    class Example:
        name: Annotated[str, "constraints"]
        count: int
        rate: float
        note: str | None
        lines: tuple[PlacedLine, ...]
        tags: list[str]

    hints = get_type_hints(Example, include_extras=True)
    types = {n: _field_type(t) for n, t in hints.items() if n != "lines"}
    assert all(t == StringType() for n, t in types.items() if n != "tags")
    assert types["tags"] == ArrayType(StringType())
    line = _field_type(tuple[PlacedLine, ...])
    assert isinstance(line, ArrayType) and isinstance(line.elementType, StructType)
    assert line.elementType["quantity"].dataType == LongType()
    assert line.elementType["royalty_rate"].dataType == DoubleType()


def test_each_record_is_parsed_once_events_and_facts_alike(spark: SparkSession) -> None:
    event = stored_event(SAMPLES[0], "e1")
    fact = dumps(  # as `streams.ingest` stores it
        FactRecord(
            "f1",
            "2026-11-25T10:00:01Z",
            "2026-11-25T10:00:02Z",
            {"customer_id": "c1", "book_id": "b1"},
        )
    )
    frame = records(spark, [event, fact], ["events.any", "streams.page_views"])
    decoded = every_event(parse_events(frame, {"streams.page_views": "page_views"}))
    # Spark's optimizer must not split the parse into one per field read (each parsing the
    # whole record again): one JSON parse per record, in the plan that runs.
    plan = decoded._jdf.queryExecution().optimizedPlan().toString()
    assert plan.count("from_json(") == 1, plan
    rows = {r["event_id"]: r for r in decoded.collect()}
    assert rows["e1"]["type"] == SAMPLES[0].type_name() and rows["e1"]["current"]
    page_view = rows["f1"]
    assert (page_view["type"], page_view["aggregate_type"]) == ("page_views", "page_views")
    assert page_view["current"] and page_view["aggregate_id"] is None
    assert page_view["data"]["book_id"] == "b1"
    assert page_view["occurred_at"] == datetime(2026, 11, 25, 10, 0, 1)
