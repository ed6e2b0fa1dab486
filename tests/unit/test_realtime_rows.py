"""The real-time query's rows, as the projector reads them from its rows topic: only those of
the query running now, each source record's once (real-time mode delivers at least once)."""

from __future__ import annotations

import json
from typing import Any

from spark.realtime import rows_of

WIDTH = 8  # the position columns and one output


def record(generation: str, topic: str, partition: int, offset: int, rows: str) -> bytes:
    position = [topic, partition, offset, True, f"e{offset}", offset * 10, 0]
    return json.dumps(
        {"g": generation, **{str(i): v for i, v in enumerate([*position, rows])}}
    ).encode()


def offsets(rows: list[list[Any]]) -> list[tuple[str, int, int]]:
    return [(r[0], r[1], r[2]) for r in rows]


def test_a_replayed_epoch_in_the_same_poll_is_taken_once() -> None:
    values = [record("g1", "t", 0, o, "[]") for o in (5, 6, 7, 5, 6, 7, 8)]
    last: dict[str, int] = {}
    assert offsets(rows_of(values, "g1", WIDTH, last)) == [("t", 0, o) for o in (5, 6, 7, 8)]
    assert last == {"t:0": 8}


def test_a_replay_in_a_later_poll_is_taken_once_and_partitions_are_apart() -> None:
    last: dict[str, int] = {}
    rows_of([record("g1", "t", 0, 5, "[]"), record("g1", "t", 1, 9, "[]")], "g1", WIDTH, last)
    again = [record("g1", "t", 0, 4, "[]"), record("g1", "t", 0, 5, "[]")]
    again += [record("g1", "t", 1, 10, "[]"), record("g1", "u", 0, 1, "[]")]
    assert offsets(rows_of(again, "g1", WIDTH, last)) == [("t", 1, 10), ("u", 0, 1)]


def test_rows_of_another_query_start_are_not_taken() -> None:
    values = [record("old", "t", 0, 6, '[{"name": "Mallory"}]'), record("g2", "t", 0, 6, "[]")]
    taken = rows_of(values, "g2", WIDTH, {})
    assert offsets(taken) == [("t", 0, 6)] and taken[0][7] == "[]"
