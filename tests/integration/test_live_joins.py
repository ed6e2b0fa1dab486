"""Joined views reach websocket subscribers, through the whole pipeline: commands → processor →
projector (projections and joins) → views → CDC → changelogs → join → view → CDC → hub → `/ws`.
Every process is started with the real CLI; the plain table is written with plain SQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from commands.messages import LogPosition
from config.settings import Settings
from config.topics import Topics
from events.base import ERASED
from stack.procs import wait_until
from stack.topics import topic_spec
from tests.changes import slot_ready
from tests.support import (
    HttpApi,
    Processes,
    cli,
    drop_cdc_slot,
    new_deployment,
    tables_holding,
    token,
    topic_records,
)
from tests.wsclient import WsClient, fold

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PIPELINE_S = 180  # first Spark batches on 2 cores are slow


class Stack:
    def __init__(self, settings: Settings, logdir: Path) -> None:
        self.settings = settings
        self.procs = Processes(settings, logdir)
        self.procs.cdc()
        wait_until(lambda: slot_ready(settings), 60, "the CDC slot")
        self.procs.processor()
        self.procs.projector()
        _, self.url = self.procs.api()
        self.procs.wait_processing(self.url, 1)
        self.api = HttpApi(self.url, token())

    def command(self, name: str, data: dict[str, Any], aggregate_id: str | None = None) -> str:
        answer = self.api.command(name, data, aggregate_id=aggregate_id)
        assert answer.status == 201, answer.body
        return str(answer.body["aggregate_id"])

    def client(self) -> WsClient:
        return WsClient(self.url.replace("http://", "ws://") + "/ws", token("views:read"))

    def sql(self, statement: str, *params: Any) -> None:
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            conn.execute(statement, params)


@pytest.fixture(scope="module")
def stack(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = new_deployment(base_settings)
    running = Stack(settings, tmp_path_factory.mktemp("live-joins"))
    try:
        yield running
    finally:
        running.procs.stop()
        drop_cdc_slot(settings)


def _rows(client: WsClient, sub: str, key: str) -> dict[Any, dict[str, Any]]:
    return fold(client.of(sub), key)


def _subscribed(client: WsClient, sub: str, view: str, filter: dict[str, Any]) -> None:
    client.subscribe(sub, view, filter)
    client.wait_for(lambda: bool(client.of(sub, "snapshot")), f"a snapshot of {view}")


def test_renaming_a_customer_reaches_every_subscriber_of_its_order_summaries(
    stack: Stack,
) -> None:
    tag = uuid.uuid4().hex[:8]
    book = stack.command(
        "add-book",
        {"title": "Dune", "author": f"Herbert {tag}", "price_cents": 1000, "royalty_rate": 0.1},
    )
    alice = stack.command("register-customer", {"name": "Alice", "email": f"a-{tag}@example.com"})
    bob = stack.command("register-customer", {"name": "Bob", "email": f"b-{tag}@example.com"})
    lines = [{"book_id": book, "quantity": 1}]
    alices = {stack.command("place-order", {"customer_id": alice, "lines": lines}) for _ in "xyz"}
    bobs = {stack.command("place-order", {"customer_id": bob, "lines": lines})}

    watchers = [stack.client() for _ in range(3)]
    bystander = stack.client()
    for client in watchers:
        # Subscribed before the join has caught up, after, in any order: all must converge.
        _subscribed(client, "mine", "order_summaries", {"customer_id": alice})
    _subscribed(bystander, "bob", "order_summaries", {"customer_id": bob})

    def holds(client: WsClient, sub: str, orders: set[str], name: str) -> bool:
        rows = _rows(client, sub, "order_id")
        return set(rows) == orders and all(r["customer_name"] == name for r in rows.values())

    for client in watchers:
        client.wait_for(lambda c=client: holds(c, "mine", alices, "Alice"), "Alice's 3", PIPELINE_S)
    bystander.wait_for(lambda: holds(bystander, "bob", bobs, "Bob"), "Bob's order", PIPELINE_S)
    bob_messages = len(bystander.of("bob"))

    renamed_at = stack.api.command(
        "rename-customer", {"name": "Alice Liddell"}, aggregate_id=alice
    ).body["position"]
    # Read-your-writes on a joined view: the read waits for the join, not only for `customers`.
    read = stack.api.get(
        "/views/order_summaries",
        params={"customer_id": alice, "consistent_with": renamed_at, "wait": 25},
        headers={"Authorization": f"Bearer {token('views:read')}"},
    )
    assert read.status_code == 200, read.text
    assert {r["customer_name"] for r in read.json()["rows"]} == {"Alice Liddell"}
    for client in watchers:
        client.wait_for(
            lambda c=client: holds(c, "mine", alices, "Alice Liddell"),
            "every summary of Alice renamed",
            PIPELINE_S,
        )
        renamed = [
            m
            for m in client.of("mine", "change")
            if m["row"] and m["row"]["customer_name"] == "Alice Liddell"
        ]
        # One change per order, no more: the join writes only rows that differ.
        assert sorted(m["key"]["order_id"] for m in renamed) == sorted(alices)
    # Rows of another customer did not change, so their subscriber got nothing.
    assert len(bystander.of("bob")) == bob_messages
    assert holds(bystander, "bob", bobs, "Bob")

    # An order's own change updates its row; a cancelled order keeps its summary (status).
    order = sorted(alices)[0]
    stack.command("cancel-order", {"reason": "changed my mind"}, aggregate_id=order)
    for client in watchers:
        client.wait_for(
            lambda c=client: _rows(c, "mine", "order_id")[order]["status"] == "cancelled",
            "the cancelled order",
            PIPELINE_S,
        )
    for client in [*watchers, bystander]:
        assert client.close_code is None
        client.close()


def test_a_subscription_consistent_with_a_command_has_it_in_its_snapshot(stack: Stack) -> None:
    """Guarantee 8 for websockets: subscribed right after the commands, with `consistent_with`
    their position, the first snapshot already holds what they wrote, on a projection's view
    and on a joined view (which also waits for CDC and the join)."""
    tag = uuid.uuid4().hex[:8]
    book = stack.command(
        "add-book",
        {"title": "Emma", "author": f"Austen {tag}", "price_cents": 999, "royalty_rate": 0.1},
    )
    registered = stack.api.command(
        "register-customer", {"name": "Cy", "email": f"c-{tag}@example.com"}
    )
    assert registered.status == 201, registered.body
    cid = registered.body["aggregate_id"]
    placed = stack.api.command(
        "place-order", {"customer_id": cid, "lines": [{"book_id": book, "quantity": 2}]}
    )
    assert placed.status == 201, placed.body
    oid = placed.body["aggregate_id"]

    client = stack.client()
    client.send(
        {
            "op": "subscribe",
            "id": "me",
            "view": "customers",
            "filter": {"customer_id": cid},
            "consistent_with": registered.body["position"],
            "wait": 30,
        }
    )
    client.send(
        {
            "op": "subscribe",
            "id": "orders",
            "view": "order_summaries",
            "filter": {"customer_id": cid},
            "consistent_with": placed.body["position"],
            "wait": 30,
        }
    )
    client.wait_for(lambda: bool(client.of("orders", "snapshot")), "both snapshots", PIPELINE_S)
    [me] = client.of("me", "snapshot")
    assert [(r["customer_id"], r["name"]) for r in me["rows"]] == [(cid, "Cy")]
    [summaries] = client.of("orders", "snapshot")
    assert [(r["order_id"], r["customer_name"]) for r in summaries["rows"]] == [(oid, "Cy")]

    # A position no command was given (past the log's end): an error at once, no snapshot.
    p = LogPosition.parse(registered.body["position"])  # customers reads its partition
    beyond = LogPosition(p.topic, p.partition, p.offset + 1_000_000).token()
    client.send(
        {
            "op": "subscribe",
            "id": "late",
            "view": "customers",
            "consistent_with": beyond,
            "wait": 30,
        }
    )
    client.wait_for(lambda: bool(client.of("late", "error")), "an error", 15)
    [error] = client.of("late", "error")
    assert error["code"] == "validation_failed" and "beyond" in error["message"], error
    assert not client.of("late", "snapshot") and not client.of("late", "subscribed")
    assert client.close_code is None
    client.close()


def test_a_plain_table_edit_reaches_the_joined_view_and_its_subscribers(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:8]
    author = f"Le Guin {tag}"
    book = stack.command(
        "add-book",
        {"title": "Earthsea", "author": author, "price_cents": 2000, "royalty_rate": 0.25},
    )
    buyer = stack.command("register-customer", {"name": "Ged", "email": f"g-{tag}@example.com"})
    order = stack.command(
        "place-order", {"customer_id": buyer, "lines": [{"book_id": book, "quantity": 2}]}
    )
    stack.command("pay-order", {"amount_cents": 4000}, aggregate_id=order)

    client = stack.client()
    _subscribed(client, "page", "author_pages", {"author": author})

    # No profile yet: an inner join has no row.
    stack.sql(
        "INSERT INTO author_profiles (author, bio, website) VALUES (%s, %s, %s)",
        author,
        "Wrote Earthsea.",
        "https://example.com/ursula",
    )

    def page() -> dict[str, Any] | None:
        return _rows(client, "page", "author").get(author)

    client.wait_for(
        lambda: (p := page()) is not None and p["bio"] == "Wrote Earthsea.",
        "the joined page",
        PIPELINE_S,
    )
    assert page() == {
        "author": author,
        "bio": "Wrote Earthsea.",
        "website": "https://example.com/ursula",
        "royalty_cents": 1000,  # 2 copies at 2000, 25 %
        "units_sold": 2,
    }

    stack.sql(
        "UPDATE author_profiles SET bio = %s WHERE author = %s", "Wrote Earthsea and more.", author
    )
    client.wait_for(
        lambda: (p := page()) is not None and p["bio"] == "Wrote Earthsea and more.",
        "the updated bio",
        PIPELINE_S,
    )

    stack.sql("DELETE FROM author_profiles WHERE author = %s", author)
    client.wait_for(lambda: page() is None, "the page deleted", PIPELINE_S)
    deletes = [m for m in client.of("page", "change") if m["op"] == "delete"]
    assert [m["key"] for m in deletes] == [{"author": author}]
    with psycopg.connect(stack.settings.database()) as conn:
        left = conn.execute("SELECT count(*) FROM author_pages WHERE author = %s", (author,))
        assert left.fetchone() == (0,)
    assert client.close_code is None
    client.close()


def test_logfold_rebuild_of_a_joined_view_sends_resync_and_a_snapshot_equal_to_it(
    stack: Stack,
) -> None:
    tag = uuid.uuid4().hex[:8]
    carol = stack.command("register-customer", {"name": "Carol", "email": f"c-{tag}@example.com"})
    book = stack.command(
        "add-book",
        {"title": "Kindred", "author": f"Butler {tag}", "price_cents": 1500, "royalty_rate": 0.1},
    )
    orders = {
        stack.command(
            "place-order", {"customer_id": carol, "lines": [{"book_id": book, "quantity": n}]}
        )
        for n in (1, 2)
    }
    client = stack.client()
    _subscribed(client, "s", "order_summaries", {"customer_id": carol})
    client.wait_for(lambda: set(_rows(client, "s", "order_id")) == orders, "Carol's", PIPELINE_S)

    done = cli(stack.settings, "rebuild", "order_summaries", "--verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify order_summaries: identical to the live view" in done.stdout

    client.wait_for(lambda: bool(client.of("s", "resync")), "resync after the rebuild", 60)
    client.wait_for(lambda: len(client.of("s", "snapshot")) == 2, "a new snapshot", 60)
    kinds = [m["type"] for m in client.of("s")]
    assert kinds[kinds.index("resync") + 1] == "snapshot", kinds
    with psycopg.connect(stack.settings.database()) as conn:
        view = conn.execute(
            "SELECT order_id, total_cents FROM order_summaries WHERE customer_id = %s", (carol,)
        ).fetchall()
    snapshot = client.of("s", "snapshot")[-1]["rows"]
    assert sorted((r["order_id"], r["total_cents"]) for r in snapshot) == sorted(view)
    assert {r[1] for r in view} == {1500, 3000}

    # And the stream goes on after the resync.
    stack.command("rename-customer", {"name": "Carol B."}, aggregate_id=carol)
    client.wait_for(
        lambda: (
            {r["customer_name"] for r in _rows(client, "s", "order_id").values()} == {"Carol B."}
        ),
        "the rename after the rebuild",
        PIPELINE_S,
    )
    client.close()


def test_a_session_merge_reaches_a_subscriber_as_a_delete_and_a_change(stack: Stack) -> None:
    """A view over a stream of facts is captured and pushed like any other: two sessions of a
    customer arrive as rows; a page view that bridges them arrives as the delete of one and the
    change of the other."""
    customer = f"reader-{uuid.uuid4().hex[:8]}"
    t = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=90)

    def views(*minutes: int) -> None:
        records = [
            {
                "id": f"pv-{uuid.uuid4().hex}",
                "occurred_at": (t + timedelta(minutes=m)).isoformat(),
                "data": {"customer_id": customer, "book_id": f"book-{m}"},
            }
            for m in minutes
        ]
        r = stack.api.session.post(
            f"{stack.url}/streams/page_views/records",
            json={"records": records},
            headers={"Authorization": f"Bearer {token('streams:write')}"},
        )
        assert r.status_code == 202, r.text

    client = stack.client()
    _subscribed(client, "s", "browsing_sessions", {"customer_id": customer})
    views(0, 40)

    def sessions() -> dict[Any, Any]:
        return {k: (r["views"], r["books"]) for k, r in _rows(client, "s", "session_start").items()}

    first, second = (t + timedelta(minutes=m) for m in (0, 40))
    iso = [x.isoformat().replace("+00:00", "Z") for x in (first, second)]
    client.wait_for(
        lambda: sessions() == {iso[0]: (1, ["book-0"]), iso[1]: (1, ["book-40"])},
        "two sessions",
        PIPELINE_S,
    )
    views(20)
    client.wait_for(
        lambda: sessions() == {iso[0]: (3, ["book-0", "book-20", "book-40"])},
        "one merged session",
        PIPELINE_S,
    )
    changes = [m for m in client.of("s") if m["type"] == "change"]
    assert [m["op"] for m in changes][-2:] in (["delete", "upsert"], ["upsert", "delete"])


def test_every_view_over_a_stream_reaches_its_subscribers(stack: Stack) -> None:
    """A page view, then an order of that book by that customer, paid: a subscriber of each
    view over event time (hopping windows, the stream-stream join, the temporal join) gets its
    rows pushed."""
    author = f"Author {uuid.uuid4().hex[:6]}"
    stack.sql(
        "INSERT INTO author_profiles (author, bio, payout_account) VALUES (%s, 'Wrote.', 'acct-9')",
        author,
    )
    customer = stack.command("register-customer", {"name": "Reader", "email": "r@example.com"})
    book = stack.command(
        "add-book", {"title": "T", "author": author, "price_cents": 700, "royalty_rate": 0.1}
    )
    client = stack.client()
    _subscribed(client, "trending", "trending_books", {"book_id": book})
    _subscribed(client, "conversions", "book_conversions", {"book_id": book})
    _subscribed(client, "payouts", "royalty_payouts", {"author": author})

    r = stack.api.session.post(
        f"{stack.url}/streams/page_views/records",
        json={
            "records": [
                {
                    "id": f"pv-{uuid.uuid4().hex}",
                    "occurred_at": (datetime.now(UTC) - timedelta(minutes=1)).isoformat(),
                    "data": {"customer_id": customer, "book_id": book},
                }
            ]
        },
        headers={"Authorization": f"Bearer {token('streams:write')}"},
    )
    assert r.status_code == 202, r.text
    order = stack.command(
        "place-order", {"customer_id": customer, "lines": [{"book_id": book, "quantity": 2}]}
    )
    paid = stack.api.command("pay-order", {"amount_cents": 1400}, aggregate_id=order)
    assert paid.status == 201, paid.body

    def held(sub: str, key: str, *columns: str) -> list[tuple[Any, ...]]:
        """The rows the client holds for `sub`, as tuples of `columns`."""
        return [tuple(r[c] for c in columns) for r in fold(client.of(sub), key).values()]

    client.wait_for(
        lambda: held("trending", "window_start", "views") == [(1,)] * 24,
        "the page view in 24 hopping windows",
        PIPELINE_S,
    )
    client.wait_for(
        lambda: held("conversions", "day", "views", "converted_views") == [(1, 1)],
        "a converted view",
        PIPELINE_S,
    )
    client.wait_for(
        lambda: held("payouts", "order_id", "order_id", "payout_account") == [(order, "acct-9")],
        "the payout with the account of its time",
        PIPELINE_S,
    )
    client.close()


def _clear_in_kafka(settings: Settings, *values: str) -> dict[str, int]:
    """Records of every topic of the deployment that hold any of `values`, per topic; but the
    commands and the joins' row hand-over, which keep them for their retention (an hour, a
    day: docs/operations.md, Erasing a customer)."""
    transient = (Topics(settings.topic_prefix).commands, Topics(settings.topic_prefix).join_rows)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka())
    try:
        names = [t for t in admin.list_topics() if t.startswith(settings.topic_prefix)]
    finally:
        admin.close()
    found = {}
    for topic in names:
        if topic in transient:
            continue
        hits = [
            r
            for r in topic_records(settings, topic)
            if any(v.encode() in (r.value or b"") + (r.key or b"") for v in values)
        ]
        if hits:
            found[topic] = len(hits)
    return found


def test_erasing_a_customer_reaches_every_derived_copy(stack: Stack) -> None:
    """Guarantee 27: register, order, subscribe, erase. Then the customer's name and email are
    nowhere: not in any Postgres table, not in any compacted topic once compacted, not in what
    subscribers are sent after the erasure; a rebuild gives the erased rows too; later commands
    on it answer 410. Its events stay in the log, unreadable."""
    tag = uuid.uuid4().hex[:8]
    name, email = f"Eve {tag}", f"eve-{tag}@example.com"
    book = stack.command(
        "add-book",
        {"title": "Beloved", "author": f"Morrison {tag}", "price_cents": 1200, "royalty_rate": 0.1},
    )
    eve = f"eve-{tag}"
    client = stack.client()
    _subscribed(client, "me", "customers", {"customer_id": eve})  # before she exists
    _subscribed(client, "orders", "order_summaries", {"customer_id": eve})
    stack.command("register-customer", {"name": name, "email": email}, aggregate_id=eve)
    order = stack.command(
        "place-order", {"customer_id": eve, "lines": [{"book_id": book, "quantity": 1}]}
    )
    # While the key exists, the views and their subscribers have the clear values.
    client.wait_for(
        lambda: _rows(client, "orders", "order_id").get(order, {}).get("customer_name") == name,
        "the order's summary with Eve's name",
        PIPELINE_S,
    )
    assert _rows(client, "me", "customer_id")[eve]["email"] == email
    assert not client.of("me", "snapshot")[0]["rows"]  # her registration came as a change
    events = Topics(stack.settings.topic_prefix).events("customer")
    assert not _clear_in_kafka(stack.settings, name, email).get(events)  # sealed in the log

    erased = stack.api.command("erase-customer", {}, aggregate_id=eve)
    assert erased.status == 201, erased.body
    client.wait_for(
        lambda: (
            _rows(client, "me", "customer_id")[eve]["name"] == ERASED
            and _rows(client, "orders", "order_id")[order]["customer_name"] == ERASED
        ),
        "the erasure pushed to both subscriptions",
        PIPELINE_S,
    )
    assert _rows(client, "me", "customer_id")[eve]["email"] == ERASED
    assert _rows(client, "orders", "order_id")[order]["customer_email"] == ERASED
    for sub in ("me", "orders"):  # the last change of her row, as pushed: no clear value
        pushed = json.dumps(client.of(sub, "change")[-1])
        assert name not in pushed and email not in pushed

    # Nothing can be done to it any more.
    renamed = stack.api.command("rename-customer", {"name": "Eve Again"}, aggregate_id=eve)
    assert (renamed.status, renamed.body["error"]["code"]) == (410, "gone"), renamed.body
    ordered = stack.api.command(
        "place-order", {"customer_id": eve, "lines": [{"book_id": book, "quantity": 1}]}
    )
    assert ordered.status == 422 and "erased" in json.dumps(ordered.body), ordered.body

    # A new subscriber, or one resuming from before the erasure, is sent no clear value.
    late = stack.client()
    _subscribed(late, "me", "customers", {"customer_id": eve})
    first = client.of("me", "snapshot")[0]["position"]
    late.subscribe("again", "customers", {"customer_id": eve}, since=first)
    late.wait_for(lambda: bool(late.of("again")), "the resumed subscription's first message")
    assert name not in json.dumps(late.messages) and email not in json.dumps(late.messages)

    assert tables_holding(stack.settings, name, email) == {}
    done = cli(stack.settings, "rebuild", "customers", "--verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify customers: identical to the live view" in done.stdout
    assert tables_holding(stack.settings, name, email) == {}

    # The changelogs, once compacted, keep only each row's newest record: the erased one.
    # (Compaction made quick here, the topics' other settings kept, as a legacy AlterConfigs
    # replaces them all; each roll of a segment needs a later record, so commands keep coming
    # while it is waited for.)
    topics = Topics.of(stack.settings)
    quick = {"min.compaction.lag.ms": "0", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01"}
    admin = KafkaAdminClient(bootstrap_servers=stack.settings.kafka())
    try:
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC,
                    topics.cdc(t),
                    configs={**topic_spec(topics, topics.cdc(t)).configs, **quick},
                )
                for t in ("customers", "order_summaries")
            ]
        )
    finally:
        admin.close()

    left: list[dict[str, int]] = []

    def compacted() -> bool:
        other = stack.command("register-customer", {"name": "Filler", "email": "f@example.com"})
        stack.command(
            "place-order", {"customer_id": other, "lines": [{"book_id": book, "quantity": 1}]}
        )
        left.append(_clear_in_kafka(stack.settings, name, email))
        return left[-1] == {}

    try:
        wait_until(compacted, 180, "no clear value left in any compacted topic")
    except TimeoutError as e:
        dump = [
            (r.offset, r.key, r.value)
            for t in left[-1]
            for r in topic_records(stack.settings, t)
            if name.encode() in (r.value or b"")
        ]
        raise AssertionError(f"clear values left, per topic: {left[-1:]} {dump}") from e
    for c in (client, late):
        c.close()
