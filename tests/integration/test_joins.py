"""Joined views on real Kafka, Postgres and Spark: the join jobs fold changelog records (written
here straight into `cdc.<table>`, as CDC would) into order_summaries and author_pages, exactly
once, through resends, restarts, kill -9 and rebuilds. An independent fold of the same records
(`Oracle`) says what the views must hold."""

from __future__ import annotations

import itertools
import json
import random
import signal
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from kafka import KafkaConsumer, TopicPartition

from app import close_app, create_app
from commands.messages import LogPosition
from config.settings import Settings
from config.topics import Topics
from projections.base import Join
from projections.base.wire import wire_row, wire_value
from projections.registry import JOINS
from stack.procs import wait_until
from tests.support import (
    Joins,
    Processes,
    append_changes,
    cli,
    end_offset,
    fill_log,
    send_again,
    token,
    topic_records,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SUMMARIES, PAGES = JOINS["order_summaries"], JOINS["author_pages"]
AUTH = {"Authorization": f"Bearer {token()}"}
T0 = datetime(2026, 11, 21, 9, 30, tzinfo=UTC)
_lsn = itertools.count(1_000_000, 7)


def position() -> str:
    """A changelog position newer than every one made before (as CDC's would be)."""
    return f"{next(_lsn)}.1"


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def customer(cid: str, name: str) -> dict[str, Any]:
    at = wire_value(T0)
    return {"customer_id": cid, "name": name, "email": f"{cid}@example.com", "registered_at": at}


def order(oid: str, cid: str | None, status: str = "placed", total: int = 1999) -> dict[str, Any]:
    return {
        "order_id": oid,
        "customer_id": cid,
        "status": status,
        "total_cents": total,
        "line_count": 2,
        "placed_at": wire_value(T0 + timedelta(minutes=1, microseconds=250)),
        "paid_at": wire_value(T0 + timedelta(minutes=2)) if status != "placed" else None,
        "shipped_at": None,
        "version": 1,
    }


class Oracle:
    """What the changelogs say, folded in plain Python: per table and key the change with the
    highest position, and the joins of those rows."""

    KEYS = {
        "orders": "order_id",
        "customers": "customer_id",
        "author_royalties": "author",
        "author_profiles": "author",
    }

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, tuple[tuple[int, int], dict[str, Any] | None]]] = {}
        self.records = 0
        self.lock = threading.Lock()

    def append(
        self, settings: Settings, table: str, *changes: tuple[str, dict[str, Any] | None]
    ) -> None:
        """Append (key value, row | None for a delete) changes with fresh positions."""
        batch = []
        for key, row in changes:
            op = "delete" if row is None else "update"
            batch.append((op, {self.KEYS[table]: key}, row, position()))
        self.replay(settings, table, batch)

    def replay(self, settings: Settings, table: str, batch: list[Any]) -> None:
        """Append changes as given (old positions too, as a CDC restart resends them)."""
        append_changes(settings, table, batch)
        with self.lock:
            self.records += len(batch)
            rows = self.rows.setdefault(table, {})
            for op, key, row, pos in batch:
                lsn, seq = (int(x) for x in pos.split("."))
                k = key[self.KEYS[table]]
                if k not in rows or rows[k][0] < (lsn, seq):
                    rows[k] = ((lsn, seq), None if op == "delete" else row)

    def live(self, table: str) -> dict[str, dict[str, Any]]:
        return {k: r for k, (_, r) in self.rows.get(table, {}).items() if r is not None}

    def view(self, join: Join) -> dict[str, dict[str, Any]]:
        left, right = self.live(join.left.table), self.live(join.right.table)
        out = {}
        for lrow in left.values():
            for rrow in right.values():
                value = lrow.get(join.left.on)
                if value is not None and value == rrow.get(join.right.on):
                    row = {
                        c: (lrow if role == "left" else rrow)[src]
                        for c, (role, src) in join.sources.items()
                    }
                    out[str(row[join.key[0]])] = row
        return out


def view_rows(settings: Settings, join: Join) -> dict[str, dict[str, Any]]:
    with psycopg.connect(settings.database()) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT {', '.join(join.columns)} FROM {join.name}")
        names = [d.name for d in cur.description or ()]
        rows = [wire_row(dict(zip(names, r, strict=True))) for r in cur.fetchall()]
    return {str(r[join.key[0]]): r for r in rows}


def versions(settings: Settings, join: Join) -> dict[str, str]:
    """Each row's xmin: it changes whenever the row is written."""
    with psycopg.connect(settings.database()) as conn:
        found = conn.execute(f"SELECT {join.key[0]}, xmin::text FROM {join.name}").fetchall()
    return {str(k): str(x) for k, x in found}


def progress(settings: Settings, join: Join) -> dict[str, Any]:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT offsets, events_applied, generation FROM projection_progress "
            "WHERE projection = %s",
            (join.name,),
        ).fetchone()
    assert row is not None
    return {"offsets": row[0], "applied": int(row[1]), "generation": int(row[2])}


def end_offsets(settings: Settings, join: Join) -> dict[str, int]:
    topics = Topics(settings.topic_prefix)
    consumer = KafkaConsumer(bootstrap_servers=settings.kafka())
    try:
        tps = [TopicPartition(topics.cdc(t), 0) for t in join.tables]
        return {f"{tp.topic}:0": int(o) for tp, o in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def caught_up(settings: Settings, join: Join, timeout: float = 120) -> None:
    """Until the join has applied every record of its changelogs."""

    def done() -> bool:
        applied = progress(settings, join)["offsets"]
        ends = end_offsets(settings, join)
        return all(int(applied.get(k, -1)) == end - 1 for k, end in ends.items() if end)

    wait_until(done, timeout, f"{join.name} to apply its changelogs")


def settled(settings: Settings, oracle: Oracle, *joins: Join, timeout: float = 120) -> None:
    """Until each view equals the oracle's fold (and the join has applied everything)."""
    for join in joins:
        caught_up(settings, join, timeout)
        assert view_rows(settings, join) == oracle.view(join), join.name


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobs(deployment: Settings, spark: Any) -> Iterator[Joins]:
    running = Joins(deployment, spark, tuple(JOINS.values()))
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


# --- order_summaries -------------------------------------------------------------------------


def test_an_order_with_its_customer_becomes_a_summary(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    cid, oid, orphan = uid("c"), uid("o"), uid("o")
    oracle.append(deployment, "customers", (cid, customer(cid, "Ada")))
    oracle.append(deployment, "orders", (oid, order(oid, cid)), (orphan, order(orphan, uid("c"))))
    settled(deployment, oracle, SUMMARIES)
    row = view_rows(deployment, SUMMARIES)[oid]
    assert row["customer_name"] == "Ada" and row["customer_email"] == f"{cid}@example.com"
    assert row["total_cents"] == 1999 and row["placed_at"] == order(oid, cid)["placed_at"]
    assert orphan not in view_rows(deployment, SUMMARIES)  # inner join: no customer, no row


def test_renaming_a_customer_updates_every_summary_of_that_customer_and_no_other(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    ada, bob = uid("c"), uid("c")
    ada_orders, bob_orders = [uid("o") for _ in range(3)], [uid("o") for _ in range(2)]
    oracle.append(deployment, "customers", (ada, customer(ada, "Ada")), (bob, customer(bob, "Bob")))
    oracle.append(
        deployment,
        "orders",
        *((o, order(o, ada)) for o in ada_orders),
        *((o, order(o, bob)) for o in bob_orders),
    )
    settled(deployment, oracle, SUMMARIES)
    before = versions(deployment, SUMMARIES)

    oracle.append(deployment, "customers", (ada, customer(ada, "Ada Lovelace")))
    settled(deployment, oracle, SUMMARIES)
    rows, after = view_rows(deployment, SUMMARIES), versions(deployment, SUMMARIES)
    assert {rows[o]["customer_name"] for o in ada_orders} == {"Ada Lovelace"}
    assert {rows[o]["customer_name"] for o in bob_orders} == {"Bob"}
    assert all(after[o] != before[o] for o in ada_orders)
    assert {k: v for k, v in after.items() if k not in ada_orders} == {
        k: v for k, v in before.items() if k not in ada_orders
    }, "rows of other customers were rewritten"


def test_an_order_change_updates_only_its_row(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    cid, first, second = uid("c"), uid("o"), uid("o")
    oracle.append(deployment, "customers", (cid, customer(cid, "Cy")))
    oracle.append(deployment, "orders", (first, order(first, cid)), (second, order(second, cid)))
    settled(deployment, oracle, SUMMARIES)
    before = versions(deployment, SUMMARIES)

    oracle.append(deployment, "orders", (first, order(first, cid, "paid", total=2500)))
    settled(deployment, oracle, SUMMARIES)
    row, after = view_rows(deployment, SUMMARIES)[first], versions(deployment, SUMMARIES)
    assert (row["status"], row["total_cents"]) == ("paid", 2500)
    assert row["paid_at"] == wire_value(T0 + timedelta(minutes=2))
    assert after[first] != before[first]
    assert {k: v for k, v in after.items() if k != first} == {
        k: v for k, v in before.items() if k != first
    }


def test_an_order_moving_to_another_customer_follows_it(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    old, new, oid = uid("c"), uid("c"), uid("o")
    oracle.append(deployment, "customers", (old, customer(old, "Old")), (new, customer(new, "New")))
    oracle.append(deployment, "orders", (oid, order(oid, old)))
    settled(deployment, oracle, SUMMARIES)
    oracle.append(deployment, "orders", (oid, order(oid, new)))
    settled(deployment, oracle, SUMMARIES)
    assert view_rows(deployment, SUMMARIES)[oid]["customer_name"] == "New"
    oracle.append(deployment, "orders", (oid, order(oid, None)))  # a null join value matches none
    settled(deployment, oracle, SUMMARIES)
    assert oid not in view_rows(deployment, SUMMARIES)


def test_deleting_a_customer_or_an_order_deletes_their_summaries(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    gone, kept = uid("c"), uid("c")
    gone_orders, kept_orders = [uid("o") for _ in range(2)], [uid("o") for _ in range(2)]
    oracle.append(deployment, "customers", (gone, customer(gone, "G")), (kept, customer(kept, "K")))
    oracle.append(
        deployment,
        "orders",
        *((o, order(o, gone)) for o in gone_orders),
        *((o, order(o, kept)) for o in kept_orders),
    )
    settled(deployment, oracle, SUMMARIES)

    oracle.append(deployment, "customers", (gone, None))
    oracle.append(deployment, "orders", (kept_orders[0], None))
    settled(deployment, oracle, SUMMARIES)
    rows = view_rows(deployment, SUMMARIES)
    assert not set(gone_orders) & set(rows)
    assert kept_orders[0] not in rows and kept_orders[1] in rows

    # The customer comes back (a new insert): the orders that still exist join it again.
    oracle.append(deployment, "customers", (gone, customer(gone, "G again")))
    settled(deployment, oracle, SUMMARIES)
    assert {view_rows(deployment, SUMMARIES)[o]["customer_name"] for o in gone_orders} == {
        "G again"
    }


def test_a_resent_older_change_changes_nothing(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    """After a restart CDC resends changes the join already has: duplicates, older versions of
    a row, and the insert of a row deleted since. None may move the view backwards."""
    cid, oid, dropped = uid("c"), uid("o"), uid("o")
    first = [("insert", {"customer_id": cid}, customer(cid, "First"), position())]
    oracle.replay(deployment, "customers", first)
    placed = [
        ("insert", {"order_id": oid}, order(oid, cid), position()),
        ("insert", {"order_id": dropped}, order(dropped, cid), position()),
    ]
    oracle.replay(deployment, "orders", placed)
    renamed = [("update", {"customer_id": cid}, customer(cid, "Second"), position())]
    oracle.replay(deployment, "customers", renamed)
    oracle.append(deployment, "orders", (dropped, None))
    settled(deployment, oracle, SUMMARIES)
    rows, before = view_rows(deployment, SUMMARIES), versions(deployment, SUMMARIES)
    assert rows[oid]["customer_name"] == "Second" and dropped not in rows
    applied = progress(deployment, SUMMARIES)["applied"]

    oracle.replay(deployment, "customers", first + renamed)  # an older row, then a duplicate
    oracle.replay(deployment, "orders", placed)  # resurrecting `dropped` would be wrong
    settled(deployment, oracle, SUMMARIES)
    assert view_rows(deployment, SUMMARIES) == rows
    assert versions(deployment, SUMMARIES) == before, "a resent change rewrote rows"
    assert progress(deployment, SUMMARIES)["applied"] == applied + 4

    # What the join keeps did not move back either: the next change re-derives the customer's
    # orders from it, and `dropped` stays deleted.
    oracle.append(deployment, "customers", (cid, customer(cid, "Third")))
    settled(deployment, oracle, SUMMARIES)
    assert dropped not in view_rows(deployment, SUMMARIES)


def test_join_rows_delivered_twice_or_left_by_a_stopped_query_change_nothing(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    """The joins' real-time query delivers at least once too (a retried task starts again from
    its epoch's first offsets), and a stopped query's rows may still be in flight: a record the
    join applied changes nothing, and rows of another query start are not applied."""
    from spark.realtime import RealTimeJoins

    assert isinstance(jobs.projector.queries["joins"], RealTimeJoins), "slots for real-time mode"
    cid, oid, other = uid("c"), uid("o"), uid("c")
    oracle.append(deployment, "customers", (cid, customer(cid, "Ada")))
    oracle.append(deployment, "orders", (oid, order(oid, cid)))
    settled(deployment, oracle, SUMMARIES)
    rows, before = view_rows(deployment, SUMMARIES), versions(deployment, SUMMARIES)
    applied = progress(deployment, SUMMARIES)["applied"]

    rows_topic = Topics(deployment.topic_prefix).join_rows
    # A record's columns by position (`CHANGELOG_COLUMNS`): 2 offset, 3 table, 5 row, 6 lsn.
    written = [r for r in topic_records(deployment, rows_topic) if cid.encode() in r.value]
    ada = [r for r in written if json.loads(r.value)["3"] == "customers"][-1]
    replayed = json.loads(ada.value)
    assert "Ada" in replayed["5"]
    stale = {**replayed, "g": "another-start", "2": replayed["2"] + 1}
    stale["5"], stale["6"] = replayed["5"].replace("Ada", "Mallory"), replayed["6"] + 10**9
    send_again(deployment, ada, replayed, stale)
    # The next customers change follows those two in the same rows partition (the same key),
    # so once it is applied, they were read.
    oracle.append(deployment, "customers", (other, customer(other, "Bob")))
    settled(deployment, oracle, SUMMARIES)
    assert view_rows(deployment, SUMMARIES) == rows
    assert versions(deployment, SUMMARIES) == before, "a record applied again rewrote rows"
    assert progress(deployment, SUMMARIES)["applied"] == applied + 1


# --- author_pages: a view joined with a plain table ------------------------------------------


def test_author_profiles_is_a_plain_table_written_with_sql(deployment: Settings) -> None:
    author = uid("Author")
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute("INSERT INTO author_profiles (author, bio) VALUES (%s, 'Wrote.')", (author,))
        conn.execute(
            "UPDATE author_profiles SET website = 'https://x' WHERE author = %s", (author,)
        )
        row = conn.execute(
            "SELECT bio, website, updated_at IS NOT NULL FROM author_profiles WHERE author = %s",
            (author,),
        ).fetchone()
        conn.execute("DELETE FROM author_profiles WHERE author = %s", (author,))
    assert row == ("Wrote.", "https://x", True)


def test_author_pages_follow_royalties_and_profiles(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    author, other = uid("Author"), uid("Author")
    royalty = {"author": author, "royalty_cents": 420, "units_sold": 3}
    oracle.append(deployment, "author_royalties", (author, royalty))
    oracle.append(
        deployment,
        "author_royalties",
        (other, {"author": other, "royalty_cents": 1, "units_sold": 1}),
    )
    profile = {"author": author, "bio": "Wrote.", "website": None, "updated_at": wire_value(T0)}
    oracle.append(deployment, "author_profiles", (author, profile))
    settled(deployment, oracle, PAGES)
    pages = view_rows(deployment, PAGES)
    assert pages[author] == {
        "author": author,
        "bio": "Wrote.",
        "website": None,
        "royalty_cents": 420,
        "units_sold": 3,
    }
    assert other not in pages  # no profile, no page

    oracle.append(deployment, "author_profiles", (author, {**profile, "website": "https://a"}))
    oracle.append(deployment, "author_royalties", (author, {**royalty, "royalty_cents": 840}))
    settled(deployment, oracle, PAGES)
    page = view_rows(deployment, PAGES)[author]
    assert (page["website"], page["royalty_cents"]) == ("https://a", 840)

    oracle.append(deployment, "author_profiles", (author, None))
    settled(deployment, oracle, PAGES)
    assert author not in view_rows(deployment, PAGES)


# --- the REST API ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(deployment: Settings) -> Iterator[FlaskClient]:
    app = create_app(deployment)
    yield app.test_client()
    close_app(app)


def test_joined_views_are_served_like_the_others(
    deployment: Settings, jobs: Joins, oracle: Oracle, api: FlaskClient
) -> None:
    cid, orders = uid("c"), sorted(uid("o") for _ in range(3))
    oracle.append(deployment, "customers", (cid, customer(cid, "Served")))
    oracle.append(deployment, "orders", *((o, order(o, cid)) for o in orders))
    settled(deployment, oracle, SUMMARIES)

    views = {v["name"]: v for v in api.get("/views", headers=AUTH).json["views"]}
    assert views["order_summaries"]["key"] == ["order_id"]
    assert views["order_summaries"]["filterable"] == ["customer_id", "status"]
    assert views["author_pages"]["columns"] == list(PAGES.columns)
    assert views["order_summaries"]["lag"]["events"] == 0

    listed = api.get(f"/views/order_summaries?customer_id={cid}&limit=2", headers=AUTH).json
    rest = api.get(
        f"/views/order_summaries?customer_id={cid}&cursor={listed['next']}", headers=AUTH
    ).json
    assert [r["order_id"] for r in listed["rows"] + rest["rows"]] == orders
    assert (
        api.get(f"/views/order_summaries/{orders[0]}", headers=AUTH).json
        == (view_rows(deployment, SUMMARIES)[orders[0]])
    )
    assert api.get("/views/order_summaries?customer_name=x", headers=AUTH).status_code == 422
    assert api.get(f"/views/order_summaries/{uid('o')}", headers=AUTH).status_code == 404


def test_a_joined_view_does_not_include_a_position_before_the_join_has_seen_it(
    deployment: Settings, api: FlaskClient
) -> None:
    topics = Topics(deployment.topic_prefix)
    # Positions of records in the log (one past its end is refused at once); only the joins
    # run here, reading changelogs, so the records need not be events.
    for aggregate in ("order", "book"):
        if not end_offset(deployment, topics.events(aggregate)):
            fill_log(deployment, topics.events(aggregate), 1, 1)
    order_partition, order_offset = 0, 0
    order_event = LogPosition(topics.events("order"), order_partition, order_offset).token()
    book_event = LogPosition(topics.events("book"), 0, 0).token()
    url = "/views/order_summaries?consistent_with={}&wait=0.2"
    assert api.get(url.format(book_event), headers=AUTH).status_code == 200  # not an input
    r = api.get(url.format(order_event), headers=AUTH)
    assert r.status_code == 504, r.json  # the orders projection has not applied it
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO projection_progress (projection, offsets) VALUES ('orders', %s) "
            "ON CONFLICT (projection) DO UPDATE SET offsets = excluded.offsets",
            (json.dumps({f"{topics.events('order')}:{order_partition}": order_offset}),),
        )
    # The orders projection has it now, but no CDC runs here: the join cannot have seen it.
    r = api.get(url.format(order_event), headers=AUTH)
    assert r.status_code == 504, r.json
    assert set(r.json["error"]["details"][0]["lag"]) >= {"events", "seconds"}


# --- crashes and rebuilds ----------------------------------------------------------------------


class Churn:
    """Changes to a fixed set of customers and orders, in a thread, until stopped."""

    def __init__(self, settings: Settings, oracle: Oracle, seed: int) -> None:
        self.settings, self.oracle, self.rng = settings, oracle, random.Random(seed)
        self.customers = [uid("churn-c") for _ in range(8)]
        self.orders = [uid("churn-o") for _ in range(40)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()

    def step(self) -> None:
        rng = self.rng
        cid = rng.choice(self.customers)
        if rng.random() < 0.3:
            row = None if rng.random() < 0.2 else customer(cid, f"name-{rng.randint(0, 999)}")
            self.oracle.append(self.settings, "customers", (cid, row))
        else:
            oid = rng.choice(self.orders)
            row = None if rng.random() < 0.1 else order(oid, cid, total=rng.randint(1, 9999))
            self.oracle.append(self.settings, "orders", (oid, row))


def test_stopping_the_join_mid_stream_loses_and_doubles_nothing(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    with Churn(deployment, oracle, seed=3):
        for _ in range(3):
            applied = progress(deployment, SUMMARIES)["applied"]
            wait_until(
                lambda a=applied: progress(deployment, SUMMARIES)["applied"] > a + 20,
                120,
                "the join to apply more changes",
            )
            jobs.stop()
            jobs.start()
    settled(deployment, oracle, SUMMARIES)
    assert progress(deployment, SUMMARIES)["applied"] == sum(
        end_offsets(deployment, SUMMARIES).values()
    ), "a changelog record was applied twice"


def test_kill_9_of_the_projector_mid_stream_loses_and_doubles_nothing(
    deployment: Settings, jobs: Joins, oracle: Oracle, tmp_path: Any
) -> None:
    """The joins run in `logfold projector` like the projections; kill -9 it meanwhile, once
    it has applied changes (the projection side's own kill -9 is in test_projector.py; each
    start of a projector costs a new JVM, so once here)."""
    jobs.stop()
    procs = Processes(deployment, tmp_path)
    try:
        procs.projector()
        with Churn(deployment, oracle, seed=9):
            applied = progress(deployment, SUMMARIES)["applied"]
            wait_until(
                lambda: progress(deployment, SUMMARIES)["applied"] > applied + 20,
                180,
                "the projector to apply more changes",
            )
            victim = procs.procs[-1]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            procs.projector()
        settled(deployment, oracle, SUMMARIES, PAGES, timeout=180)
    finally:
        procs.stop()
        jobs.start()
    assert progress(deployment, SUMMARIES)["applied"] == sum(
        end_offsets(deployment, SUMMARIES).values()
    ), "a changelog record was applied twice"


def state(settings: Settings) -> list[Any]:
    with psycopg.connect(settings.database()) as conn:
        return conn.execute(
            "SELECT join_name, side, key::text, join_value, row::text, lsn, seq FROM join_state "
            "ORDER BY 1, 2, 3"
        ).fetchall()


def test_rebuild_verify_equals_the_live_views_and_bumps_their_generation(
    deployment: Settings, jobs: Joins, oracle: Oracle
) -> None:
    settled(deployment, oracle, SUMMARIES, PAGES)
    rows, written, kept = (
        {j.name: view_rows(deployment, j) for j in (SUMMARIES, PAGES)},
        versions(deployment, SUMMARIES),
        state(deployment),
    )
    generations = {j.name: progress(deployment, j)["generation"] for j in (SUMMARIES, PAGES)}
    out = cli(deployment, "rebuild", "order_summaries", "author_pages", "--verify")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("identical to the live view") == 2, out.stdout
    assert f"order_summaries: {len(rows['order_summaries'])} rows" in out.stdout, out.stdout
    assert {j.name: view_rows(deployment, j) for j in (SUMMARIES, PAGES)} == rows
    assert versions(deployment, SUMMARIES) == written, "the rebuild rewrote equal rows"
    assert state(deployment) == kept
    for join in (SUMMARIES, PAGES):
        assert progress(deployment, join)["generation"] == generations[join.name] + 1

    # The live job goes on from the rebuild's offsets.
    cid, oid = uid("c"), uid("o")
    oracle.append(deployment, "customers", (cid, customer(cid, "After")))
    oracle.append(deployment, "orders", (oid, order(oid, cid)))
    settled(deployment, oracle, SUMMARIES)


def test_rebuild_verify_reports_and_repairs_a_view_that_went_wrong(
    deployment: Settings, jobs: Joins, oracle: Oracle, spark: Any
) -> None:
    from spark.join import JoinRebuild

    settled(deployment, oracle, SUMMARIES)
    victim = sorted(view_rows(deployment, SUMMARIES))[0]
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute(
            "UPDATE order_summaries SET customer_name = 'wrong' WHERE order_id = %s", (victim,)
        )
        conn.execute("INSERT INTO order_summaries (order_id) VALUES ('not-an-order')")
    report = JoinRebuild(deployment, spark).run(SUMMARIES, verify=True)
    assert report.differences is not None
    found = report.differences["order_summaries"]
    assert {(d[0], d[1]) for d in found} == {
        ("only_in_live", victim),
        ("only_in_rebuild", victim),
        ("only_in_live", "not-an-order"),
    }, found
    assert report.rows["order_summaries"] == len(oracle.view(SUMMARIES))
    settled(deployment, oracle, SUMMARIES)
