"""The live pipelines interpret small batches and compile large ones (`BatchCodegen`): both
must give the same rows, and the switch must follow the batch size."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from projections.registry import PROJECTIONS
from spark.event_pipeline import EVENT_COLUMNS, EventSink, sample_events
from spark.session import BatchCodegen, codegen
from stack.settings import Settings

pytestmark = pytest.mark.spark


def modes(spark: SparkSession) -> tuple[str, str]:
    return (
        spark.conf.get("spark.sql.codegen.wholeStage") or "",
        spark.conf.get("spark.sql.codegen.factoryMode") or "",
    )


def test_small_batches_are_interpreted_and_large_ones_compiled(spark: SparkSession) -> None:
    chosen = BatchCodegen(from_records=100)
    chosen.fit(spark, 0)
    assert modes(spark) == ("false", "NO_CODEGEN")
    chosen.fit(spark, 99)
    assert modes(spark) == ("false", "NO_CODEGEN")
    chosen.fit(spark, 100)
    assert modes(spark) == ("true", "FALLBACK")
    chosen.fit(spark, 3)
    assert modes(spark) == ("false", "NO_CODEGEN")


def test_every_view_gets_the_same_rows_interpreted_and_compiled(spark: SparkSession) -> None:
    settings = Settings(database_url="postgresql://unused/db", kafka_bootstrap_servers="unused:1")
    sink = EventSink(list(PROJECTIONS.values()), settings)
    events = spark.createDataFrame(sample_events(), EVENT_COLUMNS)
    batch = sink.with_rows(events)
    try:
        codegen(spark, True)
        compiled, errors = sink._collect(batch, sink.projections, lambda: events)
        assert not errors
        codegen(spark, False)
        interpreted, errors = sink._collect(batch, sink.projections, lambda: events)
        assert not errors
    finally:
        codegen(spark, True)
    assert [list(r) for r in interpreted] == [list(r) for r in compiled]
    # Every event type made rows for some view (the comparison is not of empty columns).
    assert all(any(v not in (None, "[]") for v in r[4:]) for r in compiled)
