"""What a projection parks of a batch (`spark/event_sink.parking_of`): a poison event and every
later event of its aggregate, the events of aggregates parked already, and events left out of
a real-time query's rows whose aggregate is no longer parked (parked again, to be retried);
everything else is merged. Plain Python, no Spark session."""

from __future__ import annotations

from typing import Any

from spark.event_rows import POSITION
from spark.event_sink import PARKED, UNPARKED, bounds, parking_of, unapplied_rows
from spark.parking import Poison

TOPIC = "p.events.customer"


def row(offset: int, aggregate: str, value: str = '[{"x":1}]', partition: int = 0) -> list[Any]:
    # topic, partition, offset, current, id, log time, delay, aggregate, then one output's rows
    return [TOPIC, partition, offset, True, f"id-{offset}", 0, 0, aggregate, value]


def test_a_poison_event_parks_with_every_later_event_of_its_aggregate_only() -> None:
    rows = [row(1, "a"), row(2, "b"), row(3, "a"), row(4, "c"), row(5, "b")]
    poison = Poison(TOPIC, 0, 2, "b", "ValueError: broken")
    letters, merged = parking_of(rows, POSITION, {poison.key: poison}, set())
    assert letters == [
        (TOPIC, 0, 2, "b", "ValueError: broken"),
        (TOPIC, 0, 5, "b", f"behind {TOPIC}:0:2"),
    ]
    assert [r[2] for r in merged] == [1, 3, 4]


def test_an_event_before_its_aggregates_poison_is_merged() -> None:
    rows = [row(1, "a"), row(2, "a"), row(3, "a")]
    poison = Poison(TOPIC, 0, 2, "a", "broken")
    letters, merged = parking_of(rows, POSITION, {poison.key: poison}, set())
    assert [x[2] for x in letters] == [2, 3]
    assert [r[2] for r in merged] == [1]


def test_the_events_of_an_aggregate_parked_already_park_behind_it() -> None:
    rows = [row(7, "a"), row(8, "b")]
    letters, merged = parking_of(rows, POSITION, {}, {(TOPIC, "a")})
    assert [(x[2], x[3]) for x in letters] == [(7, "a")]
    assert [r[2] for r in merged] == [8]


def test_rows_left_out_for_an_aggregate_no_longer_parked_are_parked_again_to_be_retried() -> None:
    """A real-time query left out a parked aggregate's rows; a retry finished meanwhile: the
    rows were never computed, so the events park again (and are retried), never merged."""
    rows = [row(9, "a", PARKED), row(10, "b")]
    letters, merged = parking_of(rows, POSITION, {}, set())
    assert letters == [(TOPIC, 0, 9, "a", UNPARKED)]
    assert [r[2] for r in merged] == [10]


def test_progress_moves_past_parked_events_and_earlier_records_are_not_taken_again() -> None:
    rows = [row(3, "a"), row(4, "b"), row(5, "a", partition=1)]
    reads = frozenset({f"{TOPIC}:0", f"{TOPIC}:1"})
    mine = unapplied_rows(reads, rows, {f"{TOPIC}:0": 3})
    assert [r[2] for r in mine] == [4, 5]
    after, starts = bounds({f"{TOPIC}:0": 3}, mine)
    assert after == {f"{TOPIC}:0": 4, f"{TOPIC}:1": 5}
    assert starts == {f"{TOPIC}:0": 4, f"{TOPIC}:1": 5}
