"""A join that did not read changelog records that were removed meanwhile (a projector down for
longer than the changelogs keep every change, or records deleted) may have missed a delete whose
tombstone went with them: it is rebuilt from the changelogs as they are, never left holding the
deleted row. Real Kafka, Postgres and Spark; records written straight into `cdc.<table>`."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from config.settings import Settings
from config.topics import Topics
from projections.registry import JOINS
from stack.procs import wait_until
from tests.support import (
    Joins,
    append_changes,
    delete_records,
    end_offset,
    projector_session,
    start_offset,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SUMMARIES = JOINS["order_summaries"]
_lsn = itertools.count(5_000_000, 7)


def _position() -> str:
    return f"{next(_lsn)}.1"


def _customer(cid: str, name: str) -> dict[str, Any]:
    return {"customer_id": cid, "name": name, "email": f"{cid}@example.com"}


def _order(oid: str, cid: str) -> dict[str, Any]:
    return {"order_id": oid, "customer_id": cid, "status": "placed", "total_cents": 100}


def _summaries(settings: Settings) -> dict[str, str]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute("SELECT order_id, customer_name FROM order_summaries").fetchall()
    return {str(o): str(n) for o, n in rows}


def _progress(settings: Settings) -> tuple[int, str | None]:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT generation, error FROM projection_progress WHERE projection = %s",
            (SUMMARIES.name,),
        ).fetchone()
    assert row is not None
    return int(row[0]), row[1]


def _wait(settings: Settings, condition: Callable[[], bool], timeout: float, what: str) -> None:
    """`wait_until`, failing with what the join had done by then: its rows, its progress
    (offsets, generation, error) and where each changelog now starts and ends."""
    try:
        wait_until(condition, timeout, what)
    except TimeoutError as e:
        with psycopg.connect(settings.database()) as conn:
            progress = conn.execute(
                "SELECT offsets, generation, error, updated_at FROM projection_progress "
                "WHERE projection = %s",
                (SUMMARIES.name,),
            ).fetchone()
        topics = Topics(settings.topic_prefix)
        logs = {
            t: (start_offset(settings, topics.cdc(t)), end_offset(settings, topics.cdc(t)))
            for t in SUMMARIES.tables
        }
        raise AssertionError(
            f"{e}: rows {_summaries(settings)}, progress {progress}, changelogs [start, end) {logs}"
        ) from e


@pytest.fixture(scope="module")
def joins(deployment: Settings) -> Iterator[Joins]:
    spark = projector_session(deployment, "logfold-join-gap-tests")
    running = Joins(deployment, spark, (SUMMARIES,))
    yield running
    running.stop()
    spark.stop()


def test_a_join_that_missed_a_removed_delete_is_rebuilt(deployment: Settings, joins: Joins) -> None:
    tag = uuid.uuid4().hex[:8]
    ada, bob, mine, theirs = f"ada-{tag}", f"bob-{tag}", f"o1-{tag}", f"o2-{tag}"
    append_changes(
        deployment,
        "customers",
        [
            ("insert", {"customer_id": c}, _customer(c, name), _position())
            for c, name in ((ada, "Ada"), (bob, "Bob"))
        ],
    )
    append_changes(
        deployment,
        "orders",
        [
            ("insert", {"order_id": o}, _order(o, c), _position())
            for o, c in ((mine, ada), (theirs, bob))
        ],
    )
    joins.start()
    _wait(deployment, lambda: _summaries(deployment) == {mine: "Ada", theirs: "Bob"}, 120, "rows")
    joins.stop()
    generation, _ = _progress(deployment)

    # While the join is down: Bob is deleted and Ada renamed, and the changelog loses Bob's
    # tombstone (with everything before Ada's rename) before the join reads it.
    customers = Topics(deployment.topic_prefix).cdc("customers")
    append_changes(
        deployment,
        "customers",
        [
            ("delete", {"customer_id": bob}, _customer(bob, "Bob"), _position()),
            ("update", {"customer_id": ada}, _customer(ada, "Ada L."), _position()),
        ],
    )
    delete_records(deployment, customers, end_offset(deployment, customers) - 1)

    joins.start()
    _wait(
        deployment,
        lambda: _summaries(deployment) == {mine: "Ada L."},
        180,
        "the join to drop Bob's order and rename Ada's",
    )
    _wait(deployment, lambda: _progress(deployment) == (generation + 1, None), 60, "its end")
    # It goes on live from the rebuild's offsets.
    append_changes(
        deployment,
        "customers",
        [("update", {"customer_id": ada}, _customer(ada, "Ada Lovelace"), _position())],
    )
    _wait(deployment, lambda: _summaries(deployment) == {mine: "Ada Lovelace"}, 120, "a change")
