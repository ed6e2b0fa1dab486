"""The live pipelines plan small batches lean (interpreted, fewer optimizer rules) and large
ones as Spark does (`BatchPlanning`): both must give the same rows, and the switch must follow
the batch size."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from config.settings import Settings
from projections.registry import PROJECTIONS
from spark.event_rows import sample_batch
from spark.event_sink import EventSink
from spark.session import LEAN_EXCLUDED_RULES, BatchPlanning, full_planning

pytestmark = pytest.mark.spark


LEAN = ("false", "NO_CODEGEN", ",".join(LEAN_EXCLUDED_RULES))
FULL = ("true", "FALLBACK", "")


def modes(spark: SparkSession) -> tuple[str, str, str]:
    return (
        spark.conf.get("spark.sql.codegen.wholeStage") or "",
        spark.conf.get("spark.sql.codegen.factoryMode") or "",
        spark.conf.get("spark.sql.optimizer.excludedRules", "") or "",
    )


def test_small_batches_are_planned_lean_and_large_ones_fully(spark: SparkSession) -> None:
    chosen = BatchPlanning(from_records=100)
    chosen.fit(spark, 0)
    assert modes(spark) == LEAN
    chosen.fit(spark, 99)
    assert modes(spark) == LEAN
    chosen.fit(spark, 100)
    assert modes(spark) == FULL
    chosen.fit(spark, 3)
    assert modes(spark) == LEAN


def test_every_view_gets_the_same_rows_planned_lean_and_fully(spark: SparkSession) -> None:
    settings = Settings(database_url="postgresql://unused/db", kafka_bootstrap_servers="unused:1")
    sink = EventSink(list(PROJECTIONS.values()), settings)
    events = sample_batch(spark)
    batch = sink.with_rows(events)
    try:
        full_planning(spark, True)
        full, errors = sink._collect(batch, sink.projections, lambda: events)
        assert not errors
        full_planning(spark, False)
        lean, errors = sink._collect(batch, sink.projections, lambda: events)
        assert not errors
    finally:
        full_planning(spark, True)
    assert [list(r) for r in lean] == [list(r) for r in full]
    # Every event type made rows for some view (the comparison is not of empty columns).
    assert all(any(v not in (None, "[]") for v in r[4:]) for r in full)


def test_every_rule_left_out_of_lean_planning_exists_in_this_spark(spark: SparkSession) -> None:
    """Spark ignores an unknown name in `spark.sql.optimizer.excludedRules`: a rule renamed by
    a Spark upgrade (4.2's `MergeSubplans` was `MergeScalarSubqueries`) would silently stay."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    missing = []
    for rule in LEAN_EXCLUDED_RULES:
        try:
            jvm.java.lang.Class.forName(rule + "$")  # a rule is a Scala object
        except Exception:
            missing.append(rule)
    assert not missing
