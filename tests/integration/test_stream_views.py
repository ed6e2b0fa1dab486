"""Views over streams of facts (guarantees 20 and 21) on real Kafka, Postgres and Spark: the
projector's `trending_books` (hopping windows), `browsing_sessions` (session windows) and
`book_conversions` (a stream-stream join with orders) equal an independent fold of the log
(`tests/stream_oracle.py`) with out-of-order records, records past the watermark, duplicated
ids, sessions that merge and conversions on both sides of the one-hour bound; after `kill -9` of
the projector mid-stream; and after `logfold rebuild --verify`."""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from kafka import KafkaProducer

from app import close_app, create_app
from app.read_model import ReadModel
from config.settings import Settings
from config.topics import Topics
from events.order import OrderPaid, OrderPlaced, PlacedLine
from events.partitioning import partition_for
from events.serialization import dumps
from stack.procs import wait_until
from streams.ingest import FactRecord
from tests import stream_oracle
from tests.support import (
    Processes,
    append_events,
    health_component,
    new_deployment,
    token,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {token('streams:write', 'views:read', 'admin')}"}
VIEWS = ("trending_books", "browsing_sessions", "book_conversions")  # over page_views


@pytest.fixture(scope="module")
def settings(deployment: Settings) -> Settings:
    return deployment


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[FlaskClient]:
    app = create_app(settings)
    yield app.test_client()
    close_app(app)


@pytest.fixture(scope="module")
def procs(projecting: Processes) -> Processes:
    return projecting


class PageViews:
    """Generates page views the way devices send them: out of order, some past the watermark,
    some sent twice (in the same request or a later one), in sessions that merge; and orders
    of the same customers and books, some within an hour after their views."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sent: list[dict[str, Any]] = []
        self.customers = [f"cust-{uuid.uuid4().hex[:6]}" for _ in range(6)]
        self.books = [f"book-{i}" for i in range(5)]

    def orders(self, settings: Settings, count: int) -> None:
        """Place `count` orders straight into the log, at chosen event times (one late)."""
        now = datetime.now(UTC)
        for i in range(count):
            minutes = 200 if i == 0 else self.rng.randint(0, 110)
            books = self.rng.sample(self.books, k=self.rng.randint(1, 2))
            place(
                settings, self.rng.choice(self.customers), books, now - timedelta(minutes=minutes)
            )

    def record(self, customer: str, at: datetime, book: str | None = None) -> dict[str, Any]:
        return {
            "id": f"pv-{uuid.uuid4().hex}",
            "occurred_at": at.isoformat(),
            "data": {"customer_id": customer, "book_id": book or self.rng.choice(self.books)},
        }

    def batch(self, size: int) -> list[dict[str, Any]]:
        now = datetime.now(UTC)
        out = []
        for _ in range(size):
            customer = self.rng.choice(self.customers)
            roll = self.rng.random()
            if roll < 0.08:  # past the watermark (2 hours)
                at = now - timedelta(hours=2, minutes=self.rng.randint(5, 600))
            elif roll < 0.16 and self.sent:  # a retry of a record sent before
                out.append(self.rng.choice(self.sent))
                continue
            else:  # on time, up to 110 minutes old: sessions form, split and merge
                at = now - timedelta(seconds=self.rng.randint(0, 110 * 60))
            out.append(self.record(customer, at))
        out += self.rng.sample(out, k=max(size // 20, 1))  # the same record twice in a request
        self.rng.shuffle(out)
        self.sent += out
        return out


def place(
    settings: Settings,
    customer: str,
    books: list[str],
    at: datetime,
    logged_at: datetime | None = None,
) -> str:
    lines = tuple(PlacedLine(b, 1, 100, "An Author", 0.1) for b in books)
    order = f"order-{uuid.uuid4().hex[:8]}"
    placed = OrderPlaced(customer, lines, 100)
    append_events(settings, "order", order, (1, placed, at.isoformat()), logged_at=logged_at)
    return order


def page_view_logged_at(settings: Settings, record: dict[str, Any], at: datetime) -> None:
    """Write a page view straight into its stream as if the API had received it at `at`."""
    fact = FactRecord(record["id"], record["occurred_at"], at.isoformat(), record["data"])
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka(), transactional_id=f"test-{uuid.uuid4()}", acks="all"
    )
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(
        Topics(settings.topic_prefix).stream("page_views"),
        key=fact.id.encode(),
        value=dumps(fact),
        partition=partition_for(fact.data["customer_id"], settings.partitions),
        timestamp_ms=round(at.timestamp() * 1e3),
    )
    producer.commit_transaction()
    producer.close()


def post(api: FlaskClient, records: list[dict[str, Any]]) -> None:
    r = api.post("/streams/page_views/records", json={"records": records}, headers=AUTH)
    assert r.status_code == 202, r.json


def caught_up(settings: Settings, timeout: float = 180) -> None:
    model = ReadModel(settings)
    try:
        wait_until(
            lambda: all(model.lag()[v]["events"] == 0 for v in VIEWS),
            timeout,
            "the stream views to catch up with the stream",
        )
    finally:
        model.engine.dispose()


def late_counts(settings: Settings) -> dict[str, int]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT projection, late_events FROM projection_progress WHERE projection = ANY(%s)",
            (list(VIEWS),),
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def test_sessions_merge_when_a_late_view_bridges_them(
    api: FlaskClient, procs: Processes, settings: Settings
) -> None:
    gen = PageViews(seed=1)
    customer = f"bridge-{uuid.uuid4().hex[:6]}"
    t = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=100)
    post(
        api, [gen.record(customer, t, "b1"), gen.record(customer, t + timedelta(minutes=40), "b2")]
    )
    # Exactly the gap apart is not closer than it: another session.
    post(api, [gen.record(customer, t + timedelta(minutes=70), "b3")])
    caught_up(settings)
    assert sessions_of(settings, customer) == [
        (t, t, 1, ["b1"]),
        (t + timedelta(minutes=40), t + timedelta(minutes=40), 1, ["b2"]),
        (t + timedelta(minutes=70), t + timedelta(minutes=70), 1, ["b3"]),
    ]
    # A view that arrives late (within the watermark) between the first two joins them.
    post(api, [gen.record(customer, t + timedelta(minutes=20), "b1")])
    caught_up(settings)
    assert sessions_of(settings, customer) == [
        (t, t + timedelta(minutes=40), 3, ["b1", "b2"]),
        (t + timedelta(minutes=70), t + timedelta(minutes=70), 1, ["b3"]),
    ]


def test_a_view_converts_once_within_the_hour_whichever_side_comes_first(
    api: FlaskClient, procs: Processes, settings: Settings
) -> None:
    gen = PageViews(seed=5)
    book = f"conv-{uuid.uuid4().hex[:6]}"
    alice, bob, carol, dave = (
        f"{n}-{uuid.uuid4().hex[:6]}" for n in ("alice", "bob", "carol", "dave")
    )
    t = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=100)
    # Alice: the view first, then two orders within the hour (it converts once).
    post(api, [gen.record(alice, t, book)])
    caught_up(settings)
    place(settings, alice, [book], t + timedelta(minutes=59))
    place(settings, alice, [book], t + timedelta(minutes=60))
    # Bob: the order first (at one hour and a minute after the view: too late), the view after.
    # Dave: the order first too, exactly an hour after the view (within it): the view converts.
    place(settings, bob, [book], t + timedelta(minutes=61))
    place(settings, dave, [book], t + timedelta(minutes=60))
    caught_up(settings)
    post(api, [gen.record(bob, t, book), gen.record(dave, t, book)])
    # Carol: an order before the view does not convert it; one placed later, sent late, does.
    place(settings, carol, [book], t - timedelta(minutes=1))
    post(api, [gen.record(carol, t, book)])
    caught_up(settings)
    place(settings, carol, [book], t + timedelta(minutes=30))
    caught_up(settings)
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT views, converted_views FROM book_conversions WHERE book_id = %s AND day = %s",
            (book, t.date()),
        ).fetchone()
    assert row == (4, 3)
    r = api.get(f"/views/book_conversions?book_id={book}", headers=AUTH)
    assert r.status_code == 200, r.json
    assert r.json["rows"] == [
        {"book_id": book, "day": t.date().isoformat(), "views": 4, "converted_views": 3}
    ]


def state_of(settings: Settings, view_id: str, order_id: str) -> dict[str, Any]:
    with psycopg.connect(settings.database()) as conn:

        def count(sql: str, *params: Any) -> int:
            row = conn.execute(sql, params).fetchone()
            return int(row[0]) if row else 0

        return {
            "view": count("SELECT count(*) FROM conversion_views WHERE view_id = %s", view_id),
            "order": count("SELECT count(*) FROM conversion_orders WHERE order_id = %s", order_id),
            "ids": count("SELECT count(*) FROM stream_ids WHERE id = %s", view_id),
        }


def test_state_that_nothing_on_time_can_match_any_more_is_dropped(
    api: FlaskClient, procs: Processes, settings: Settings
) -> None:
    """The join's two sides and the counted ids are kept only while a record on time could
    still need them (`docs/streams.md`): a view and an order received six hours ago, on time
    then, are in the state until newer records move the watermark past them."""
    gen = PageViews(seed=6)
    customer, book = f"old-{uuid.uuid4().hex[:6]}", f"book-old-{uuid.uuid4().hex[:6]}"
    then = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=6)
    old_view = gen.record(customer, then, book)
    page_view_logged_at(settings, old_view, then)
    order = place(settings, customer, [book], then + timedelta(minutes=5), logged_at=then)
    caught_up(settings)
    assert state_of(settings, old_view["id"], order) == {
        "view": 1,
        "order": 1,
        "ids": len(VIEWS),  # every view over the stream counted it
    }
    # A page view of now (another book: it would share the old one's day after 6 am UTC).
    post(api, [gen.record(customer, datetime.now(UTC) - timedelta(minutes=1), book + "-new")])
    caught_up(settings)
    assert state_of(settings, old_view["id"], order) == {"view": 0, "order": 0, "ids": 0}
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT views, converted_views FROM book_conversions WHERE book_id = %s AND day = %s",
            (book, then.date()),
        ).fetchone()
    assert row == (1, 1)  # what it counted stays
    assert stream_oracle.differences(settings) == {}


def pay(settings: Settings, author: str, at: datetime, cents: int = 1000) -> str:
    """An order of one book by `author` paid at `at`, straight into the log; its id."""
    order = f"order-{uuid.uuid4().hex[:8]}"
    line = PlacedLine(f"book-by-{author}", 1, cents, author, 0.1)
    append_events(settings, "order", order, (2, OrderPaid(cents, (line,)), at.isoformat()))
    return order


def sql(settings: Settings, statement: str, *params: Any) -> None:
    with psycopg.connect(settings.database()) as conn:
        conn.execute(statement, params)


def payout_accounts(settings: Settings) -> dict[str, str | None]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute("SELECT order_id, payout_account FROM royalty_payouts").fetchall()
    return dict(rows)


def payouts_caught_up(settings: Settings, orders: int) -> None:
    wait_until(lambda: len(payout_accounts(settings)) >= orders, 120, "the payouts")


def test_a_payout_uses_the_profile_as_it_was_when_paid(
    api: FlaskClient, procs: Processes, settings: Settings, spark: Any
) -> None:
    from projections import royalty_payouts
    from spark.rebuild import Rebuild

    le_guin, nobody = f"Le Guin {uuid.uuid4().hex[:6]}", f"Nobody {uuid.uuid4().hex[:6]}"
    sql(
        settings,
        "INSERT INTO author_profiles (author, bio, payout_account) VALUES (%s, 'Wrote.', 'acct-1')",
        le_guin,
    )
    before = datetime.now(UTC)
    already = len(payout_accounts(settings))
    first = pay(settings, le_guin, before)
    no_profile = pay(settings, nobody, before, cents=500)
    payouts_caught_up(settings, already + 2)
    sql(settings, "UPDATE author_profiles SET payout_account = 'acct-2' WHERE author = %s", le_guin)
    second = pay(settings, le_guin, datetime.now(UTC))
    # Paid before the change, but reaching the log after it: the account of its time.
    backdated = pay(settings, le_guin, before)
    sql(settings, "DELETE FROM author_profiles WHERE author = %s", le_guin)
    gone = pay(settings, le_guin, datetime.now(UTC))
    wait_until(lambda: gone in payout_accounts(settings), 120, "the last payout")
    accounts = payout_accounts(settings)
    assert [accounts[o] for o in (first, second, backdated, gone, no_profile)] == [
        "acct-1",
        "acct-2",
        "acct-1",
        None,
        None,
    ]
    assert stream_oracle.compare_payouts(settings) == {}
    health_component(
        api,
        "projection:royalty_payouts",
        lambda c: c.get("counted", {}).get("payouts_without_account") == 2,
    )
    metrics = api.get("/metrics", headers=AUTH).get_data(as_text=True)
    assert (
        'logfold_view_rows{component="projection:royalty_payouts",count="payouts_without_account"}'
        " 2.0" in metrics
    )
    (report,) = Rebuild(settings, spark).run_many([royalty_payouts.projection], verify=True)
    assert report.differences == {"royalty_payouts": []}
    assert payout_accounts(settings) == accounts


def sessions_of(settings: Settings, customer: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT session_start, session_end, views, books FROM browsing_sessions "
            "WHERE customer_id = %s ORDER BY session_start",
            (customer,),
        ).fetchall()
    return [tuple(r) for r in rows]


def test_views_equal_the_fold_of_the_stream(
    api: FlaskClient, procs: Processes, settings: Settings
) -> None:
    gen = PageViews(seed=2)
    for _ in range(4):
        post(api, gen.batch(200))
        gen.orders(settings, 15)
    caught_up(settings)
    assert stream_oracle.differences(settings) == {}
    _, late = stream_oracle.expected(settings)
    assert all(late.values())
    assert late_counts(settings) == late
    want = late["trending_books"]
    health_component(api, "projection:trending_books", lambda c: c.get("late_events") == want)
    metrics = api.get("/metrics", headers=AUTH).get_data(as_text=True)
    n = late["book_conversions"]
    assert f'logfold_late_events{{component="projection:book_conversions"}} {n}.0' in metrics
    converted = stream_oracle.actual(settings)["book_conversions"]
    assert sum(r["converted_views"] for r in converted.values()) > 0


def test_kill_9_of_the_projector_mid_stream_counts_each_record_once(
    api: FlaskClient, procs: Processes, settings: Settings
) -> None:
    gen = PageViews(seed=3)
    stop = threading.Event()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            while not stop.wait(0.05):  # about 20 requests a second
                post(api, gen.batch(50))
                gen.orders(settings, 2)
                pay(settings, gen.rng.choice(["Austen", "Brontë"]), datetime.now(UTC))
        except BaseException as e:  # surfaced below
            errors.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        for _ in range(2):
            before = applied(settings)
            wait_until(lambda b=before: applied(settings) > b + 100, 180, "more records applied")
            procs.kill_9_projector()
    finally:
        stop.set()
        sender.join()
    assert not errors, errors
    caught_up(settings)
    assert stream_oracle.differences(settings) == {}
    assert stream_oracle.compare_payouts(settings) == {}


def applied(settings: Settings) -> int:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(events_applied), 0) FROM projection_progress "
            "WHERE projection = ANY(%s)",
            (list(VIEWS),),
        ).fetchone()
    return int(row[0]) if row else 0


def test_rebuild_verify_finds_the_live_views_identical(
    api: FlaskClient, procs: Processes, settings: Settings, spark: Any
) -> None:
    """A rebuild beside the live projector (in this process: `logfold rebuild --all --verify`
    itself runs in tests/integration/test_projector.py)."""
    from projections.registry import PROJECTIONS
    from spark.rebuild import Rebuild

    gen = PageViews(seed=4)
    post(api, gen.batch(300))
    gen.orders(settings, 30)
    caught_up(settings)
    reports = Rebuild(settings, spark).run_many([PROJECTIONS[v] for v in VIEWS], verify=True)
    differences = {r.projection: r.differences for r in reports}
    assert differences == {v: {v: []} for v in VIEWS}
    caught_up(settings)
    assert stream_oracle.differences(settings) == {}
    with psycopg.connect(settings.database()) as conn:
        folds = dict(conn.execute("SELECT fold, count(*) FROM stream_ids GROUP BY fold").fetchall())
    assert set(folds) == set(VIEWS)  # the rebuild's ids replaced the live ones
    # Records sent again after the rebuild are still counted once.
    post(api, gen.sent[:100])
    caught_up(settings)
    assert stream_oracle.differences(settings) == {}


def test_a_rebuild_before_any_projector_ran_counts_late_records_as_the_projector_does(
    base_settings: Settings, spark: Any
) -> None:
    """With no projector ever run, the rebuilt views replace empty live ones whole, progress and
    counts included: the late records, which no table holds, must be counted all the same."""
    from projections.registry import PROJECTIONS
    from spark.rebuild import Rebuild

    own = new_deployment(base_settings)
    app = create_app(own)
    try:
        gen = PageViews(seed=6)
        for _ in range(2):
            post(app.test_client(), gen.batch(150))
        gen.orders(own, 10)
    finally:
        close_app(app)
    Rebuild(own, spark).run_many([PROJECTIONS[v] for v in VIEWS], progress=False)
    assert stream_oracle.differences(own) == {}
    _, late = stream_oracle.expected(own)
    assert all(late.values())
    assert late_counts(own) == late


def test_a_batch_merged_in_many_chunks_gives_the_rows_of_one_merged_at_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large batch (a rebuild, a catch-up) is merged in chunks, in log order per partition,
    not in time order: an order six hours older than the newest may come in a chunk before
    the newest and its view in one after. State is dropped once the whole batch is in, so the
    view still finds its order, as when the batch is merged at once."""
    from projections.book_conversions import projection as conversions
    from spark import event_rows
    from spark.event_rows import Share, merge_share

    then = datetime(2026, 1, 1, tzinfo=UTC)
    now = then + timedelta(hours=6)

    def side(kind: str, id: str, at: datetime) -> str:
        row = {"kind": kind, "id": id, "customer_id": "c", "book_id": "b", "at": at.isoformat()}
        return json.dumps([row])

    share = Share(
        offsets={},
        after={},
        first={},
        count=4,
        rows={"book_conversions": [side("order", "o-old", then), side("order", "o-new", now)]},
        records=[
            ("v-old", int(then.timestamp() * 1e6), [side("view", "v-old", then)]),
            ("v-new", int(now.timestamp() * 1e6), [side("view", "v-new", now)]),
        ],
    )

    def merged(chunk_bytes: int) -> list[tuple[Any, ...]]:
        monkeypatch.setattr(event_rows, "MERGE_CHUNK_BYTES", chunk_bytes)
        with psycopg.connect(settings.database()) as conn:
            for table in ("book_conversions", "conversion_views", "conversion_orders"):
                conn.execute(f"CREATE TEMP TABLE {table}__chunks (LIKE {table} INCLUDING ALL)")
            merge_share(conn, conversions, share, "__chunks", timedelta(hours=3))
            rows = conn.execute(
                "SELECT book_id, day, views, converted_views FROM book_conversions__chunks"
            ).fetchall()
            conn.rollback()  # temporary tables, and the ids counted for the fold "…__chunks"
        return [tuple(r) for r in rows]

    assert merged(1) == merged(10**9) == [("b", then.date(), 2, 2)]


def test_a_rebuilds_first_merge_into_empty_tables_gives_the_rows_of_the_live_merge(
    settings: Settings,
) -> None:
    """A rebuild merges the whole log's staged rows into new, empty shadows without their keys
    (built after it): its statements must give the tables the live merge gives, keeping each
    key once (a record sent again, a book on two lines of an order)."""
    from projections.book_conversions import BATCH_COLUMNS, conversions
    from spark.sink import drop_keys

    t = datetime(2026, 1, 1, 12, tzinfo=UTC)
    staged = [
        ("view", "v-converts", "alice", "b1", t),
        ("view", "v-converts", "alice", "b1", t),  # sent again
        ("order", "o-1", "alice", "b1", t + timedelta(minutes=30)),
        ("order", "o-1", "alice", "b1", t + timedelta(minutes=30)),  # the book on two lines
        ("order", "o-1", "alice", "b2", t + timedelta(minutes=30)),
        ("view", "v-too-late", "bob", "b1", t),
        ("order", "o-2", "bob", "b1", t + timedelta(minutes=61)),
        ("view", "v-ordered-before", "carol", "b2", t),
        ("order", "o-3", "carol", "b2", t - timedelta(minutes=1)),
        ("view", "v-next-day", "alice", "b2", t + timedelta(hours=12)),
        ("order", "o-4", "alice", "b2", t + timedelta(hours=12, minutes=59)),
    ]
    tables = ("book_conversions", "conversion_views", "conversion_orders")

    def merged(suffix: str, empty: bool) -> dict[str, list[tuple[Any, ...]]]:
        with psycopg.connect(settings.database()) as conn:
            for table in tables:
                conn.execute(f"CREATE TEMP TABLE {table}{suffix} (LIKE {table} INCLUDING ALL)")
            conn.execute(f"CREATE TEMP TABLE staged{suffix} ({BATCH_COLUMNS})")
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO staged{suffix} VALUES (%s, %s, %s, %s, %s)", staged)
            keys = drop_keys(conn, [t + suffix for t in tables]) if empty else []
            for statement in conversions.merge_staged_statements(suffix, f"staged{suffix}", empty):
                conn.execute(statement)
            for statement in keys:
                conn.execute(statement)
            found = {
                table: [
                    tuple(r) for r in conn.execute(f"SELECT * FROM {table}{suffix} ORDER BY 1, 2")
                ]
                for table in tables
            }
            keyed = conn.execute(
                "SELECT count(*) FROM pg_constraint WHERE contype = 'p' "
                "AND conrelid = ANY(%s::regclass[])",
                ([t + suffix for t in tables],),
            ).fetchone()
            conn.rollback()
        assert keyed == (3,)  # the keys are back
        return found

    live, first = merged("__live", empty=False), merged("__first", empty=True)
    assert first == live
    day, next_day = t.date(), t.date() + timedelta(days=1)
    assert live["book_conversions"] == [
        ("b1", day, 2, 1),
        ("b2", day, 1, 0),
        ("b2", next_day, 1, 1),
    ]
