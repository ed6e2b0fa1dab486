"""A local Spark master is given a task slot per partition the projector's real-time queries
read (a local thread is a slot, not a core); any other master is left as it is."""

from __future__ import annotations

import os

import pytest

from config.settings import Settings
from config.topics import Topics
from projections.registry import JOINS, PROJECTIONS
from spark.event_pipeline import realtime_slots
from spark.session import with_slots


@pytest.mark.parametrize(
    ("master", "slots", "expected"),
    [
        ("local", 18, "local[18]"),
        ("local[4]", 18, "local[18]"),
        ("local[32]", 18, "local[32]"),
        ("local[4,3]", 18, "local[18,3]"),
        ("local[2]", 0, "local[2]"),
        ("spark://host:7077", 18, "spark://host:7077"),
        ("yarn", 18, "yarn"),
        ("local-cluster[2,1,1024]", 18, "local-cluster[2,1,1024]"),
    ],
)
def test_a_local_master_gets_the_slots_asked_for(master: str, slots: int, expected: str) -> None:
    assert with_slots(master, slots) == expected


def test_local_star_means_at_least_the_cores() -> None:
    cores = os.cpu_count() or 1
    assert with_slots("local[*]", 1) == f"local[{cores}]"
    assert with_slots("local[*]", cores + 5) == f"local[{cores + 5}]"


def test_the_projector_asks_for_a_slot_per_partition_read_and_two_more() -> None:
    settings = Settings(partitions=4)
    topics = {t for p in PROJECTIONS.values() for t in p.topic_names(Topics())}
    assert realtime_slots(settings, list(PROJECTIONS.values())) == len(topics) * 4 + 2
    assert realtime_slots(Settings(partitions=1), list(PROJECTIONS.values())) == len(topics) + 2


def test_the_joins_add_a_slot_per_changelog_they_read() -> None:
    settings = Settings(partitions=4)
    projections = list(PROJECTIONS.values())
    tables = {t for j in JOINS.values() for t in j.tables}
    assert tables, "the bookshop has joins"
    with_joins = realtime_slots(settings, projections, list(JOINS.values()))
    assert with_joins == realtime_slots(settings, projections) + len(tables)
