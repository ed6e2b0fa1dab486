"""The read side on real Kafka, Postgres and Spark: the projector folds the log into views
exactly once, through crashes, duplicates and rebuilds; reads can wait for a write."""

from __future__ import annotations

import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient

from config.settings import Settings
from projections.registry import PROJECTIONS, VIEWS
from stack.procs import wait_until
from tests.oracle import actual, differences
from tests.support import (
    Processes,
    append_events,
    caught_up,
    cli,
    health_component,
    log_of,
    new_deployment,
    token,
)
from tests.workload import Workload

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {token()}"}


@pytest.fixture(scope="module")
def procs(projecting: Processes) -> Processes:
    return projecting


@pytest.fixture(scope="module")
def workload(client: FlaskClient) -> Workload:
    def post(name: str, body: dict[str, Any]) -> tuple[int, Any]:
        r = client.post(f"/commands/{name}", json=body, headers=AUTH)
        return r.status_code, r.json

    load = Workload(post, seed=11)
    load.seed()
    return load


def run_load(load: Workload, commands: int, threads: int = 4) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: load.step(), range(commands)))
    assert not [s for s in load.statuses if s >= 500], load.statuses


def test_a_read_with_the_commands_position_sees_the_write(
    client: FlaskClient, procs: Processes
) -> None:
    r = client.post(
        "/commands/register-customer",
        headers=AUTH,
        json={"data": {"name": "Grace", "email": "grace@example.com"}},
    )
    assert r.status_code == 201
    cid, position = r.json["aggregate_id"], r.json["position"]
    # The first read may come before Spark has started; a 504 says so, and we ask again.
    answers = []
    url = f"/views/customers/{cid}?consistent_with={position}&wait=30"
    wait_until(
        lambda: answers.append(client.get(url, headers=AUTH)) or answers[-1].status_code != 504,
        180,
        "the customer in the view",
    )
    row = answers[-1]
    assert row.status_code == 200, row.json
    assert {a.status_code for a in answers} <= {200, 504}
    assert row.json["name"] == "Grace" and row.json["version"] == 1
    listed = client.get("/views/customers?email=grace@example.com", headers=AUTH).json
    assert [x["customer_id"] for x in listed["rows"]] == [cid]
    views = client.get("/views", headers=AUTH).json["views"]
    assert {v["name"] for v in views} >= {
        "customers",
        "books",
        "orders",
        "author_royalties",
        "sales_by_hour",
    }


def test_views_equal_the_fold_of_the_log(
    workload: Workload, procs: Processes, deployment: Settings
) -> None:
    run_load(workload, 300)
    caught_up(deployment)
    assert differences(deployment) == {}


def test_kill_9_of_the_projector_mid_stream_loses_and_doubles_nothing(
    workload: Workload, procs: Processes, deployment: Settings
) -> None:
    stop = threading.Event()
    loader = threading.Thread(target=lambda: [workload.step() for _ in iter(stop.is_set, True)])
    loader.start()
    rng = random.Random(5)
    try:
        for _ in range(2):
            before = applied(deployment)
            wait_until(
                lambda b=before: applied(deployment) > b + rng.randint(20, 120),
                120,
                "the projector to apply more events",
            )
            procs.kill_9_projector()
    finally:
        stop.set()
        loader.join()
    caught_up(deployment)
    assert differences(deployment) == {}


def applied(settings: Settings) -> int:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute("SELECT coalesce(sum(events_applied), 0) FROM projection_progress")
        return int(row.fetchone()[0])  # type: ignore[index]


def test_replaying_already_applied_events_changes_nothing(
    procs: Processes, deployment: Settings, spark: Any
) -> None:
    """The whole log, given again to the pipeline's batch function as one batch (a duplicated
    delivery), changes no view: every projection has applied it already."""
    from config.topics import Topics
    from projections.registry import PROJECTIONS
    from spark.decode import every_event, parse_events, read_batch
    from spark.event_sink import EventSink

    caught_up(deployment)
    before = actual(deployment)
    topics = Topics(deployment.topic_prefix)
    names = sorted({topics.events(t) for p in PROJECTIONS.values() for t in p.topics})
    log = every_event(
        parse_events(read_batch(spark, deployment.kafka(), names, "earliest", "latest"))
    )
    sink = EventSink(list(PROJECTIONS.values()), deployment)
    records = log
    sink.records = lambda _: records
    log = sink.with_rows(log)
    try:
        sink(log, 0)
    finally:
        sink.db.close()
    assert not sink.failed
    assert actual(deployment) == before


WRITE_RATE = 20  # commands a second while the rebuild runs


@pytest.mark.timeout(1200)  # beyond its command's own bound (900 s), on a slow, busy machine
def test_rebuild_all_verify_while_commands_flow(
    workload: Workload, procs: Processes, deployment: Settings
) -> None:
    run_load(workload, 600, threads=8)
    caught_up(deployment)
    counts = row_counts(deployment)
    seen: list[dict[str, int]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(row_counts(deployment))

    def write() -> None:
        # Paced (WRITE_RATE a second): a writer as fast as it can go makes the log grow as
        # fast as the rebuild folds it, and the test as long as the machine is slow.
        while not stop.wait(1 / WRITE_RATE):
            workload.step()

    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    try:
        out = cli(deployment, "rebuild", "--all", "--verify", timeout=900)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert out.returncode == 0, out.stdout + out.stderr
    # Done by the running projector, in its driver (no driver of the command's own).
    projector = procs.procs[-1].pid
    assert f":{projector}) is rebuilding" in out.stderr, out.stderr
    with psycopg.connect(deployment.database()) as conn:
        asked = conn.execute(
            "SELECT claimed_by, finished_at IS NOT NULL, error FROM rebuild_requests"
        ).fetchall()
    assert [(by.rsplit(":", 1)[1], done, error) for by, done, error in asked] == [
        (str(projector), True, None)
    ]
    # Every view: the projections' and the joins' (whose changelogs nobody writes here).
    assert out.stdout.count("identical to the live view") == len(VIEWS), out.stdout
    assert seen, "the reader never ran"
    for sample in seen:
        for view, n in counts.items():
            assert sample[view] >= n, (
                f"{view} had {sample[view]} rows during the rebuild, {n} before"
            )
    caught_up(deployment)
    assert differences(deployment) == {}
    with psycopg.connect(deployment.database()) as conn:
        generations = {r[0] for r in conn.execute("SELECT generation FROM projection_progress")}
    assert generations == {1}


# After every test that needs a load answered without a 5xx: this one writes to the log itself,
# so the processor's next write to that partition finds its offset moved and starts a new session
# (as designed), which on a busy machine can outlast the commands' deadline (honest 504s).
def test_a_late_payment_is_kept_out_of_windows_but_counted_and_reported(
    client: FlaskClient, procs: Processes, deployment: Settings, workload: Workload
) -> None:
    """A payment written with an event time three hours before its append time (as a backfill or a
    skewed clock would) is past the watermark."""
    from datetime import UTC, datetime, timedelta

    from events.order import OrderPaid, OrderPlaced, PlacedLine

    order_id, long_ago = f"late-{uuid.uuid4().hex[:8]}", datetime.now(UTC) - timedelta(hours=3)
    at = long_ago.isoformat().replace("+00:00", "Z")
    line = PlacedLine(next(iter(workload.books)), 3, 700, "Backfill", 0.2)
    append_events(
        deployment,
        "order",
        order_id,
        (1, OrderPlaced("c-late", (line,), 2100), at),
        (2, OrderPaid(2100, (line,)), at),
    )
    caught_up(deployment)
    assert differences(deployment) == {}
    with psycopg.connect(deployment.database()) as conn:
        late = conn.execute("SELECT count(*) FROM late_events").fetchone()[0]  # type: ignore[index]
        hour = long_ago.replace(minute=0, second=0, microsecond=0)
        windows = conn.execute(
            "SELECT count(*) FROM sales_by_hour WHERE book_id = %s AND window_start = %s",
            (line.book_id, hour),
        )
        assert (late, windows.fetchone()[0]) == (1, 0)  # type: ignore[index]
        royalty = conn.execute(
            "SELECT royalty_cents FROM author_royalties WHERE author = 'Backfill'"
        )
        assert royalty.fetchone() == (420,)
    # The late event shows in /health within a round of its background checks.
    health_component(client, "projection:sales_by_hour", lambda c: c.get("late_events") == 1)
    metrics = client.get("/metrics", headers=AUTH).get_data(as_text=True)
    assert 'logfold_late_events{component="projection:sales_by_hour"} 1.0' in metrics


def test_a_rebuild_before_any_projector_ran_fills_the_views_and_counts_each_event_once(
    base_settings: Settings, spark: Any
) -> None:
    """With no projector ever run, the rebuilt views replace empty live ones whole (the log is
    not applied to them first): views and progress must come out as the projector's would, so
    that a projector started afterwards goes on from there and applies nothing twice."""
    from datetime import UTC, datetime, timedelta

    from events.book import BookAdded
    from events.customer import CustomerRegistered
    from events.order import OrderPaid, OrderPlaced, PlacedLine
    from spark.projector import Projector
    from spark.rebuild import Rebuild

    settings = new_deployment(base_settings)
    now = datetime.now(UTC)
    line = PlacedLine("b-1", 2, 900, "Le Guin", 0.1)

    def at(t: datetime) -> str:
        return t.isoformat().replace("+00:00", "Z")

    def order(n: int, when: datetime) -> None:
        placed, paid = OrderPlaced("c-1", (line,), 1800), OrderPaid(1800, (line,))
        append_events(settings, "order", f"o-{n}", (1, placed, at(when)), (2, paid, at(when)))

    def progress() -> dict[str, tuple[int, int]]:
        with psycopg.connect(settings.database()) as conn:
            rows = conn.execute(
                "SELECT projection, events_applied, late_events FROM projection_progress"
            )
            return {r[0]: (r[1], r[2]) for r in rows}

    def events_in_log() -> dict[str, int]:
        return {
            p: sum(len(log_of(settings, t)) for t in PROJECTIONS[p].topics) for p in PROJECTIONS
        }

    customer = CustomerRegistered("Ursula", "ursula@example.com")
    append_events(settings, "customer", "c-1", (1, customer, at(now)))
    book = BookAdded("The Dispossessed", "Le Guin", 900, 0.1)
    append_events(settings, "book", "b-1", (1, book, at(now)))
    order(1, now)
    order(2, now - timedelta(hours=3))  # paid past the watermark: late for sales_by_hour
    # In this process, with the module's Spark (`logfold rebuild --all` runs the same, from
    # the command line, in test_rebuild_all_verify_while_commands_flow).
    Rebuild(settings, spark).run_many(list(PROJECTIONS.values()), progress=False)
    assert differences(settings) == {}
    counted = progress()
    assert {p: counted[p][0] for p in PROJECTIONS} == events_in_log()
    assert counted["sales_by_hour"] == (4, 1)

    projector = Projector(settings, spark, projections=tuple(PROJECTIONS.values()), joins=())
    query = projector.start("events")
    try:
        order(3, now)
        caught_up(settings, timeout=180)
        assert differences(settings) == {}
        assert {p: n for p, (n, _) in progress().items() if p in PROJECTIONS} == events_in_log()
        assert progress()["sales_by_hour"] == (6, 1)
    finally:
        query.stop()


def test_a_shadow_merged_from_the_whole_log_keeps_its_keys_and_gets_its_indexes_back(
    deployment: Settings,
) -> None:
    """A replayed view's shadows are merged without their secondary indexes, which are built
    once after the whole log: keys and unique indexes stay (`ON CONFLICT` needs them), and
    every index dropped comes back as it was."""
    from spark.sink import drop_indexes

    def indexes(conn: psycopg.Connection[Any]) -> dict[str, str]:
        rows = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'probe'")
        return {r[0]: r[1] for r in rows}

    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS probe")
        conn.execute("CREATE TABLE probe (a text PRIMARY KEY, b text UNIQUE, c text, d int)")
        conn.execute("CREATE INDEX probe_cd ON probe (c, d DESC)")
        conn.execute("CREATE INDEX probe_positive ON probe (d) WHERE d > 0")
        before = indexes(conn)
        again = drop_indexes(conn, ["probe"])
        assert indexes(conn) == {n: d for n, d in before.items() if "UNIQUE" in d}
        assert len(again) == 2
        for statement in again:
            conn.execute(statement)
        assert indexes(conn) == before
        conn.execute("DROP TABLE probe")


def row_counts(settings: Settings) -> dict[str, int]:
    views = ("customers", "books", "orders", "author_royalties", "sales_by_hour")
    with psycopg.connect(settings.database()) as conn:
        return {v: conn.execute(f"SELECT count(*) FROM {v}").fetchone()[0] for v in views}  # type: ignore[index]


def test_a_rebuild_in_the_projector_plans_fully_while_its_live_queries_plan_lean(
    spark: Any,
) -> None:
    """The live queries set their session to plan lean (interpreted expressions, fewer
    optimizer rules: right for a few records); a rebuild or a changed version's build run in
    the projector beside them gets a session of its own that plans as Spark does by default
    (the whole log interpreted took twice as long), and leaves theirs as it was."""
    from spark.session import LEAN_EXCLUDED_RULES, batch_session, full_planning

    full_planning(spark, False)
    try:
        own = batch_session(spark)
        assert own.sparkContext is spark.sparkContext
        assert own.conf.get("spark.sql.codegen.wholeStage") == "true"
        assert own.conf.get("spark.sql.codegen.factoryMode") == "FALLBACK"
        assert not own.conf.get("spark.sql.optimizer.excludedRules", "")
        assert own.conf.get("spark.sql.shuffle.partitions") == spark.conf.get(
            "spark.sql.shuffle.partitions"
        )
        assert spark.conf.get("spark.sql.codegen.wholeStage") == "false"
        assert LEAN_EXCLUDED_RULES[0] in spark.conf.get("spark.sql.optimizer.excludedRules")
    finally:
        full_planning(spark, True)
