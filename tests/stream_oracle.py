"""The views over streams of facts as they should be: an independent, plain-Python fold of the
stream topics (with each record's Kafka timestamp: when the API received it). Shares no code
with the projections: it applies the rules as `docs/streams.md` states them."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kafka import TopicPartition

from events.store import committed_reader
from stack.settings import Settings
from stack.topics import Topics
from tests.oracle import compare, read_views

LATENESS = timedelta(hours=2)  # of every page-view view
HOUR, DAY, GAP = timedelta(hours=1), timedelta(days=1), timedelta(minutes=30)
Rows = dict[tuple[Any, ...], dict[str, Any]]


@dataclass
class Fact:
    id: str
    occurred_at: datetime
    logged_at: datetime  # the Kafka timestamp: when the API received it
    data: dict[str, Any]


@dataclass
class Counted:
    """What a view counts of a stream: the on-time first copies, and how many were late."""

    facts: list[Fact] = field(default_factory=list)
    late: int = 0


def read_stream(settings: Settings, stream: str) -> list[list[Fact]]:
    """Every committed record of the stream, per partition, in log order."""
    topic = Topics(settings.topic_prefix).stream(stream)
    consumer = committed_reader(settings.kafka())
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        consumer.seek_to_beginning(*tps)
        out: dict[int, list[Fact]] = defaultdict(list)
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            for tp, records in consumer.poll(timeout_ms=1000).items():
                for r in records:
                    doc = json.loads(r.value)
                    out[tp.partition].append(
                        Fact(
                            doc["id"],
                            datetime.fromisoformat(doc["occurred_at"]),
                            datetime.fromtimestamp(r.timestamp / 1000, UTC),
                            doc["data"],
                        )
                    )
        return [out[p] for p in range(settings.partitions)]
    finally:
        consumer.close()


def counted(partitions: list[list[Fact]], lateness: timedelta = LATENESS) -> Counted:
    result = Counted()
    seen: set[str] = set()
    for facts in partitions:
        for f in facts:
            if f.logged_at - f.occurred_at > lateness:
                result.late += 1
            elif f.id not in seen:
                seen.add(f.id)
                result.facts.append(f)
    return result


def trending_books(facts: list[Fact]) -> Rows:
    rows: Rows = {}
    for f in facts:
        epoch = int(f.occurred_at.timestamp())
        newest = epoch - epoch % 3600
        for k in range(24):
            start = datetime.fromtimestamp(newest - k * 3600, UTC)
            row = rows.setdefault(
                (f.data["book_id"], start), {"window_end": start + DAY, "views": 0}
            )
            row["views"] += 1
    return rows


def browsing_sessions(facts: list[Fact]) -> Rows:
    by_customer: dict[str, list[Fact]] = defaultdict(list)
    for f in facts:
        by_customer[f.data["customer_id"]].append(f)
    rows: Rows = {}
    for customer, views in by_customer.items():
        views.sort(key=lambda f: f.occurred_at)
        session: list[Fact] = []
        for f in [*views, None]:
            if session and (f is None or f.occurred_at - session[-1].occurred_at >= GAP):
                rows[(customer, session[0].occurred_at)] = {
                    "session_end": session[-1].occurred_at,
                    "views": len(session),
                    "books": sorted({s.data["book_id"] for s in session}),
                }
                session = []
            if f is not None:
                session.append(f)
    return rows


def expected(settings: Settings) -> tuple[dict[str, Rows], int]:
    """The stream views' rows, and the late records each counts."""
    views = counted(read_stream(settings, "page_views"))
    return {
        "trending_books": trending_books(views.facts),
        "browsing_sessions": browsing_sessions(views.facts),
    }, views.late


KEYS = {
    "trending_books": ["book_id", "window_start"],
    "browsing_sessions": ["customer_id", "session_start"],
}


def actual(settings: Settings) -> dict[str, Rows]:
    return read_views(settings, KEYS)


def differences(settings: Settings) -> dict[str, Any]:
    """Per view, the keys whose rows differ (expected, actual); empty when all match."""
    return compare(expected(settings)[0], actual(settings))
