"""What a projection over a stream takes from a batch (`share_of`): its watermark per record,
its stream records set apart to be counted once by id, its progress; and batches merged in
parts (`_chunks`). Plain Python, no Spark session."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from projections import trending_books
from projections.base import Projection
from spark.event_rows import POSITION, _chunks, share_of

STREAM, EVENTS = "p.streams.page_views", "p.events.order"
HOUR_US = 3_600_000_000


def row(topic: str, offset: int, delay_us: int, value: str = '[{"x":1}]') -> list[Any]:
    # topic, partition, offset, current, id, log time (µs), delay (µs), aggregate, then one
    # output's rows
    return [topic, 0, offset, True, f"id-{offset}", 10 * HOUR_US + offset, delay_us, "c", value]


VIEW = Projection(
    "v",
    topics=("order",),
    streams=("page_views",),
    lateness=timedelta(hours=2),
    outputs=(trending_books.windows,),
)
READS = frozenset({f"{STREAM}:0", f"{EVENTS}:0"})


def test_records_past_the_watermark_are_counted_late_and_left_out() -> None:
    rows = [row(STREAM, 0, HOUR_US), row(STREAM, 1, 2 * HOUR_US + 1), row(STREAM, 2, 2 * HOUR_US)]
    share = share_of(VIEW, READS, frozenset({STREAM}), rows, POSITION, {})
    assert share is not None
    assert share.late == 1
    assert [r[0] for r in share.records] == ["id-0", "id-2"]  # exactly the watermark is on time
    assert share.count == 3 and share.after == {f"{STREAM}:0": 2}


def test_stream_records_wait_for_their_ids_and_events_do_not() -> None:
    rows = [row(EVENTS, 5, 0, '[{"e":1}]'), row(STREAM, 3, 0, "[]"), row(STREAM, 4, 0)]
    share = share_of(VIEW, READS, frozenset({STREAM}), rows, POSITION, {f"{STREAM}:0": 3})
    assert share is not None
    assert share.rows == {"trending_books": ['[{"e":1}]']}
    assert [(r[0], r[1]) for r in share.records] == [("id-4", 10 * HOUR_US + 4)]
    assert share.count == 2  # offset 3 was applied before
    assert share.first == {f"{EVENTS}:0": 5, f"{STREAM}:0": 4}


def test_nothing_after_the_progress_is_no_share() -> None:
    assert (
        share_of(
            VIEW, READS, frozenset({STREAM}), [row(STREAM, 1, 0)], POSITION, {f"{STREAM}:0": 1}
        )
        is None
    )


def test_chunks_keep_every_array_in_order_within_the_size(monkeypatch: Any) -> None:
    monkeypatch.setattr("spark.event_rows.MERGE_CHUNK_BYTES", 40)
    arrays = ["[" + "x" * n + "]" for n in (10, 20, 30, 5, 50)]  # 12, 22, 32, 7, 52 bytes
    chunks = list(_chunks(arrays))
    assert chunks == [arrays[:2], arrays[2:4], arrays[4:]]  # one too big goes alone
