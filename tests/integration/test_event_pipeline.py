"""The event pipeline (one query for every projection), run in this process on real Kafka,
Postgres and Spark:

- guarantee 26: an event a projection's fold raises on (in Spark, or in Postgres) parks with
  every later event of its aggregate while every other aggregate flows; a retry once fixed
  applies them in order, once; a skip is recorded and a rebuild leaves out the same;
- guarantee 16: a fold that raises on every event is marked failed (in /health and /metrics,
  with the error and the offsets it could not get past) while the others in the same query go
  on; once fixed and restarted it catches up from its own progress and rejoins;
- events at an older schema version, in a batch with current ones, are folded in their
  upcast form (the Python upcasters run only for them), live and in a rebuild;
- records deleted from the log before a projection applied them are reported, not skipped in
  silence."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from app import close_app, create_app
from config.settings import Settings
from config.topics import Topics
from events.book import BookAdded
from events.customer import CustomerRegistered, CustomerRenamed
from events.order import OrderPaid, OrderPlaced, PlacedLine
from events.partitioning import partition_for
from projections import customers, orders
from projections.base import Output, Projection, dead_letters, versions
from projections.registry import PROJECTIONS
from stack import cli
from stack.procs import wait_until
from tests.integration.test_upcasting import produce_raw, v1_customer_registered
from tests.oracle import differences
from tests.support import (
    append_events,
    cli_env,
    delete_records,
    health_component,
    new_deployment,
    send_again,
    token,
    topic_records,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark]

ADMIN = {"Authorization": f"Bearer {token('admin')}"}
AT = "2026-11-23T10:00:00+00:00"
POISON = "Poison Pill"


def broken_rows() -> Any:
    """customers' rows, except that the customer named POISON makes them raise (a bug)."""
    from projections.base.rows import F, field, rows_column

    poisoned = F.coalesce(field("name") == POISON, F.lit(False))
    fine = rows_column(customers.output)
    return F.when(poisoned, F.raise_error(F.lit("deliberately broken"))).otherwise(fine)


def customers_with(rows: Any, version: str | None = "same") -> Projection:
    """The customers projection with its rows given by `rows`: at the real one's version (a
    bug in the same version: `same`), at `version`, or at the one derived from it (None)."""
    output = customers.output
    return Projection(
        "customers",
        topics=("customer",),
        outputs=(
            Output(output.table, rows=rows, merge=output.merge, filterable=output.filterable),
        ),
        version=versions.of(customers.projection) if version == "same" else version,
    )


BROKEN = customers_with(broken_rows)


def run_events(settings: Settings, spark: Any, projections: tuple[Projection, ...]) -> Any:
    """The event pipeline of `projections`, in this process (as the projector runs it)."""
    from spark.projector import Projector

    projector = Projector(settings, spark, projections=projections, joins=())
    projector.start("events")
    return projector


def stop(projector: Any) -> None:
    for query in projector.queries.values():
        query.stop()


def customer_names(settings: Settings) -> set[str]:
    with psycopg.connect(settings.database()) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM customers").fetchall()}


def order_ids(settings: Settings) -> set[str]:
    with psycopg.connect(settings.database()) as conn:
        return {r[0] for r in conn.execute("SELECT order_id FROM orders").fetchall()}


def failure(settings: Settings) -> tuple[str | None, dict[str, int] | None]:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT error, error_offsets FROM projection_progress WHERE projection = 'customers'"
        ).fetchone()
    return (row[0], row[1]) if row else (None, None)


def register(settings: Settings, name: str) -> str:
    cid = f"c-{uuid.uuid4().hex[:8]}"
    append_events(settings, "customer", cid, (1, CustomerRegistered(name, f"{cid}@x.org"), AT))
    return cid


def place(settings: Settings) -> str:
    oid = f"o-{uuid.uuid4().hex[:8]}"
    line = PlacedLine("dune", 1, 1000, "Herbert", 0.1)
    append_events(settings, "order", oid, (1, OrderPlaced("c", (line,), 1000), AT))
    return oid


def parked(settings: Settings, projection: str = "customers") -> list[tuple[str, str]]:
    """`projection`'s parked events in log order: (aggregate, error) each."""
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT aggregate, error FROM parked_events WHERE projection = %s "
            'ORDER BY topic, partition, "offset"',
            (projection,),
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def retry(settings: Settings, projector: Any, projection: str = "customers") -> int:
    """Ask for a retry of every parked event of `projection`, as `logfold dead-letters retry`
    does, and run the projector's retrier once (its thread runs under `Projector.run`)."""
    with psycopg.connect(settings.database()) as conn:
        dead_letters.request_retry(conn, projection)
    return int(projector.retrier.run_once())


def events_applied(settings: Settings, projection: str = "customers") -> int:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT events_applied FROM projection_progress WHERE projection = %s", (projection,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_poison_event_parks_its_aggregate_while_the_rest_flows_and_a_retry_applies_it(
    deployment: Settings, spark: Any
) -> None:
    """Guarantee 26: the event a fold raises on parks, with every later event of its
    aggregate, in order; every other aggregate (of the same projection too) keeps flowing; it
    shows in /health, /metrics and GET /views; once the fold is fixed, a retry applies the
    parked events in order, once."""
    projector = running_live(deployment, spark, (BROKEN, orders.projection))
    try:
        register(deployment, "Ada")
        wait_until(lambda: "Ada" in customer_names(deployment), 120, "Ada in customers")

        pill = register(deployment, POISON)  # stops the real-time query; the catch-up parks it
        append_events(deployment, "customer", pill, (2, CustomerRenamed("Pill Renamed"), AT))
        wait_until(lambda: len(parked(deployment)) == 2, 120, "the pill's two events parked")

        # The other aggregates flow: in the same projection, and beside it.
        after = [place(deployment) for _ in range(3)]
        register(deployment, "Cy")
        wait_until(
            lambda: set(after) <= order_ids(deployment) and "Cy" in customer_names(deployment),
            120,
            "orders and Cy after the poison",
        )
        assert customer_names(deployment) == {"Ada", "Cy"}  # the pill's row: none yet
        letters = parked(deployment)
        assert [a for a, _ in letters] == [pill, pill]
        assert "deliberately broken" in letters[0][1]
        assert letters[1][1].startswith("behind ")  # parked behind the first, in order
        assert failure(deployment) == (None, None)  # not stopped: one aggregate waits
        assert projector.queries["events"].isActive

        app = create_app(deployment)
        try:
            client = app.test_client()
            component = health_component(
                client, "projection:customers", lambda c: c.get("parked_events") == 2, ADMIN
            )
            assert component["status"] == "up" and component["parked_aggregates"] == 1
            assert "deliberately broken" in component["first_parked_error"]  # admin only
            public = client.get("/health").json["components"]["projection:customers"]
            assert public["parked_events"] == 2 and "first_parked_error" not in public
            metrics = client.get("/metrics", headers=ADMIN).get_data(as_text=True)
            assert 'logfold_parked_events{component="projection:customers"} 2.0' in metrics
            both = {"Authorization": f"Bearer {token('views:read', 'admin')}"}
            views = client.get("/views", headers=both).json["views"]
            lag = next(v["lag"] for v in views if v["name"] == "customers")
            assert lag["parked_events"] == 2 and "deliberately broken" in lag["first_parked_error"]
        finally:
            close_app(app)

        # Retried with the fold still broken: it stops at the same event, applying nothing.
        assert retry(deployment, projector) == 0
        assert [a for a, _ in parked(deployment)] == [pill, pill]
        assert "deliberately broken" in parked(deployment)[0][1]
    finally:
        stop(projector)

    # The fold fixed and deployed: a retry applies the parked events in order, each once.
    projector = run_events(deployment, spark, (customers.projection, orders.projection))
    try:
        assert retry(deployment, projector) == 2
        assert parked(deployment) == []
        assert customer_names(deployment) == {"Ada", "Pill Renamed", "Cy"}
        assert retry(deployment, projector) == 0  # nothing left: nothing twice
        register(deployment, "Di")  # and the pill's projection flows on
        wait_until(lambda: "Di" in customer_names(deployment), 120, "Di after the retry")
        assert events_applied(deployment) == 5  # Ada, the pill's two, Cy, Di: each once
        assert "customers" not in differences(deployment)
    finally:
        stop(projector)


def always_broken_rows() -> Any:
    """customers' rows that raise for every event (a bug in the fold, not in an event)."""
    from projections.base.rows import F, rows_column

    broken = F.col("aggregate_id").isNotNull()
    fine = rows_column(customers.output)
    return F.when(broken, F.raise_error(F.lit("broken for every event"))).otherwise(fine)


ALWAYS_BROKEN = customers_with(always_broken_rows)


def test_a_fold_failing_on_every_event_stops_alone_is_reported_and_catches_up_once_fixed(
    base_settings: Settings, spark: Any
) -> None:
    """Guarantee 16: a fold that raises on every event of a batch (of several aggregates) is
    the fold's fault, not an event's: it stops (failed, with its error and offsets, in /health
    and /metrics) instead of parking everything, the others in the same query go on, and once
    fixed it resumes from its own progress. Its warm-up meets the broken fold first, and
    leaves it to the real batches."""
    deployment = new_deployment(base_settings, projector_warm_up_rounds=3)
    register(deployment, "Ada")
    register(deployment, "Bo")
    order = place(deployment)
    projector = run_events(deployment, spark, (ALWAYS_BROKEN, orders.projection))
    try:
        wait_until(lambda: failure(deployment)[0] is not None, 120, "customers marked failed")
        error, offsets = failure(deployment)
        assert error is not None and "broken for every event" in error
        assert offsets, "the failure names the offsets it could not get past"
        wait_until(lambda: order in order_ids(deployment), 120, "the order beside it")
        assert customer_names(deployment) == set() and parked(deployment) == []
        assert projector.queries["events"].isActive
        app = create_app(deployment)
        try:
            client = app.test_client()
            component = health_component(
                client, "projection:customers", lambda c: c["status"] == "failed", ADMIN
            )
            assert "broken for every event" in component["error"]  # shown to admin callers only
            unauthenticated = client.get("/health").json["components"]["projection:customers"]
            assert unauthenticated["status"] == "failed" and "error" not in unauthenticated
            assert component["failed_at_offsets"] == offsets
            assert component["lag_events"] > 0
            assert client.get("/health").json["components"]["projection:orders"]["status"] == "up"
            metrics = client.get("/metrics", headers=ADMIN).get_data(as_text=True)
            assert 'logfold_component_failed{component="projection:customers"} 1.0' in metrics
            assert 'logfold_component_failed{component="projection:orders"} 0.0' in metrics
        finally:
            close_app(app)
    finally:
        stop(projector)

    projector = run_events(deployment, spark, (customers.projection, orders.projection))
    try:
        wait_until(lambda: customer_names(deployment) == {"Ada", "Bo"}, 120, "caught up")
        assert failure(deployment) == (None, None)
        assert events_applied(deployment) == 2  # each event once, none twice
    finally:
        stop(projector)


def test_an_event_postgres_refuses_parks_and_a_skip_is_recorded_and_rebuilt_alike(
    base_settings: Settings, spark: Any, tmp_path: Path
) -> None:
    """Guarantee 26 in Postgres: an event whose rows the table refuses (here a rule added to
    it) parks with the events behind it; skipping it is explicit and recorded, the rest are
    retried, and a rebuild leaves out exactly what was skipped: it equals the live view."""
    from spark.rebuild import Rebuild

    deployment = new_deployment(base_settings)
    with psycopg.connect(deployment.database()) as conn:
        conn.execute(
            "ALTER TABLE customers ADD CONSTRAINT not_refused "
            "CHECK (name IS DISTINCT FROM 'Refused')"
        )
    register(deployment, "Ada")
    refused = register(deployment, "Refused")
    register(deployment, "Cy")
    projector = run_events(deployment, spark, (customers.projection,))
    try:
        wait_until(lambda: len(parked(deployment)) == 1, 120, "the refused event parked")
        wait_until(lambda: customer_names(deployment) == {"Ada", "Cy"}, 120, "the others")
        # (In the same batch, the rename would have combined with the registration into one
        # row the rule accepts: rows of one key combine before Postgres sees them.)
        append_events(deployment, "customer", refused, (2, CustomerRenamed("Accepted"), AT))
        wait_until(lambda: len(parked(deployment)) == 2, 120, "the rename parked behind it")
        assert "not_refused" in parked(deployment)[0][1]
        assert failure(deployment) == (None, None)

        env = {"DATABASE_URL": deployment.database(), "LOGFOLD_HOME": str(tmp_path)}
        listed = CliRunner().invoke(cli.main, ["dead-letters", "list", "customers"], env=env)
        assert listed.exit_code == 0, listed.output
        assert "customers: 2 parked events of 1 aggregates" in listed.output
        assert listed.output.count(refused) == 2 and "not_refused" in listed.output

        app = create_app(deployment)
        try:
            client = app.test_client()
            url = "/dead-letters/customers"
            shown = client.get(url, headers=ADMIN).json["events"]
            assert [(e["aggregate"], e["skip_reason"]) for e in shown] == [(refused, None)] * 2
            summary = client.get("/dead-letters", headers=ADMIN).json["projections"]
            assert {"projection": "customers", "parked_events": 2} | next(
                x for x in summary if x["projection"] == "customers"
            ) == next(x for x in summary if x["projection"] == "customers")
            # Bad input changes nothing; only `admin` may ask.
            viewer = {"Authorization": f"Bearer {token('views:read')}"}
            assert (
                client.post(f"{url}/skip", json={"aggregate": refused}, headers=ADMIN).status_code
                == 422
            )
            assert (
                client.post(
                    f"{url}/skip", json={"aggregate": refused, "reason": "r"}, headers=viewer
                ).status_code
                == 403
            )
            assert client.post("/dead-letters/nope/retry", headers=ADMIN).status_code == 404
            missing = {"aggregate": "c-nobody", "reason": "r"}
            assert client.post(f"{url}/skip", json=missing, headers=ADMIN).status_code == 404
            asked = client.post(
                f"{url}/skip",
                json={"aggregate": refused, "reason": "a rule the name broke"},
                headers=ADMIN,
            )
            assert asked.status_code == 202 and asked.json["skip_requested"] == 1
        finally:
            close_app(app)
        # The projector skips it, on record, and retries the rename behind it.
        assert projector.retrier.run_once() == 1
        assert parked(deployment) == []
        assert customer_names(deployment) == {"Ada", "Accepted", "Cy"}
        with psycopg.connect(deployment.database()) as conn:
            recorded = conn.execute("SELECT aggregate, reason FROM skipped_events").fetchall()
        assert recorded == [(refused, "a rule the name broke")]
    finally:
        stop(projector)

    report = Rebuild(deployment, spark).run(customers.projection, verify=True, progress=False)
    assert report.differences == {"customers": []}
    assert report.skipped_events == 1 and report.parked_aggregates == 0
    assert customer_names(deployment) == {"Ada", "Accepted", "Cy"}


def test_a_retry_that_crashes_between_chunks_loses_and_doubles_nothing(
    base_settings: Settings, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry applies each chunk of parked events and removes their letters in one
    transaction: a crash in the middle of one (here after its rows are merged, before the
    commit, as a `kill -9` would leave it) keeps the chunks before it and none of it; the
    next retry goes on from there, and every event is applied once."""
    from spark import retrier

    deployment = new_deployment(base_settings)
    register(deployment, "Ada")
    pill = register(deployment, POISON)
    for version, name in ((2, "Second"), (3, "Third")):
        append_events(deployment, "customer", pill, (version, CustomerRenamed(name), AT))
    projector = run_events(deployment, spark, (BROKEN,))
    try:
        wait_until(lambda: len(parked(deployment)) == 3, 120, "the pill's three events parked")
    finally:
        stop(projector)

    projector = run_events(deployment, spark, (customers.projection,))
    try:
        monkeypatch.setattr(retrier, "CHUNK", 1)
        unpark, calls = dead_letters.unpark, []

        def crash_on_the_second(conn: Any, letters: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("crashed mid-retry")
            unpark(conn, letters)

        monkeypatch.setattr(dead_letters, "unpark", crash_on_the_second)
        with psycopg.connect(deployment.database()) as conn:
            dead_letters.request_retry(conn, "customers")
        with pytest.raises(RuntimeError, match="crashed mid-retry"):
            projector.retrier.run_once()
        assert len(parked(deployment)) == 2  # the first chunk held, the second left no trace
        assert customer_names(deployment) == {"Ada", POISON}
        assert events_applied(deployment) == 2

        monkeypatch.setattr(dead_letters, "unpark", unpark)
        assert projector.retrier.run_once() == 2  # the request stands: it goes on
        assert parked(deployment) == []
        assert customer_names(deployment) == {"Ada", "Third"}
        assert events_applied(deployment) == 4  # each event once
        assert "customers" not in differences(deployment)
    finally:
        stop(projector)


def upper_rows() -> Any:
    """customers' rows with the names in capitals: a changed fold."""
    from projections.base.rows import F, field, one, when_type

    return one(
        customers.table,
        F.col("aggregate_type") == "customer",
        customer_id=F.col("aggregate_id"),
        name=F.upper(when_type(("CustomerRegistered", "CustomerRenamed"), field("name"))),
        email=when_type(("CustomerRegistered", "CustomerEmailChanged"), field("email")),
        registered_at=when_type("CustomerRegistered", F.col("occurred_at")),
        version=F.col("version"),
    )


UPPER = customers_with(upper_rows, version=None)  # its version derived: another one


def live_version_of(settings: Settings, projection: str = "customers") -> Any:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT version, building_version, build_error FROM projection_progress "
            "WHERE projection = %s",
            (projection,),
        ).fetchone()
    return row


def test_a_changed_projection_is_built_beside_the_live_one_and_swapped_in_atomically(
    base_settings: Settings, spark: Any, tmp_path: Path
) -> None:
    """Guarantee 25: a projector whose fold of a projection changed builds its version from the
    log beside the live tables, which keep serving, and swaps it in at once: no read sees a
    gap, an empty view or a mix of versions; the swapped view is the new fold of the log,
    events that arrived during the build included. A build that fails leaves the live version
    serving and says why."""
    from spark import keeping
    from spark.deploy import Deployer
    from spark.projector import Projector
    from spark.rebuild import Rebuild

    deployment = new_deployment(base_settings)
    for name in ("Ada", "Bo", "Cy"):
        register(deployment, name)
    projector = run_events(deployment, spark, (customers.projection,))
    try:
        wait_until(lambda: customer_names(deployment) == {"Ada", "Bo", "Cy"}, 120, "v1 live")
    finally:
        stop(projector)
    assert versions.of(UPPER) != versions.of(customers.projection)
    assert live_version_of(deployment)[0] == versions.of(customers.projection)

    seen: list[frozenset[str]] = []
    reading = threading.Event()
    reading.set()

    def read() -> None:
        with psycopg.connect(deployment.database(), autocommit=True) as conn:
            while reading.is_set():
                rows = conn.execute("SELECT name FROM customers").fetchall()
                seen.append(frozenset(r[0] for r in rows))

    reader = threading.Thread(target=read)
    reader.start()
    projector = Projector(deployment, spark, projections=(UPPER,), joins=())
    running = threading.Thread(target=projector.run)
    running.start()
    try:
        register(deployment, "Di")  # commands flow while it deploys
        wait_until(
            lambda: live_version_of(deployment)[0] == versions.of(UPPER), 240, "v2 swapped in"
        )
        wait_until(lambda: customer_names(deployment) == {"ADA", "BO", "CY", "DI"}, 120, "v2 live")
        register(deployment, "Ed")  # and the new version folds live from there
        wait_until(lambda: "ED" in customer_names(deployment), 120, "Ed folded by v2")
    finally:
        reading.clear()
        reader.join()
        projector.stop()
        running.join(timeout=120)
    old = [s for s in seen if s <= {"Ada", "Bo", "Cy"}]
    new = [s for s in seen if all(n.isupper() for n in s)]
    assert all(seen), "a read saw an empty view"
    assert len(old) + len(new) == len(seen), [s for s in seen if s not in old and s not in new]
    assert old and new
    first_new = next(i for i, s in enumerate(seen) if s in new)
    assert all(s in new for s in seen[first_new:])  # old, then new: never back, never a mix
    assert all(len(s) == 3 for s in old)  # never a gap
    assert live_version_of(deployment)[1:] == (None, None)
    report = Rebuild(deployment, spark).run(UPPER, verify=True, progress=False)
    assert report.differences == {"customers": []}  # the new fold of the log, exactly

    # `logfold projections`, run with the code of the real projection: another version is live.
    env = cli_env(deployment, tmp_path)
    listed = CliRunner().invoke(cli.main, ["projections"], env=env)
    assert listed.exit_code == 0, listed.output
    [line] = [x for x in listed.output.splitlines() if x.startswith("customers ")]
    assert versions.of(customers.projection) in line and versions.of(UPPER) in line
    assert "another version is live" in line
    v1, v2 = versions.of(customers.projection), versions.of(UPPER)
    assert line.split()[5] == v1  # kept for a rollback

    # Rolling back: v1's build starts from its kept tables and folds only the events since
    # (Di, Ed); v2 is kept in turn. Rolling forward again, verified, starts from v2's.
    deployer = Deployer(spark, deployment, [customers.projection])
    assert deployer.build(customers.projection) is True
    assert deployer.reports["customers"].restored == v1
    assert customer_names(deployment) == {"Ada", "Bo", "Cy", "Di", "Ed"}
    assert live_version_of(deployment)[0] == v1
    report = Rebuild(deployment, spark).run(customers.projection, verify=True, progress=False)
    assert report.differences == {"customers": []}
    with psycopg.connect(deployment.database()) as conn:
        assert [k.version for k in keeping.kept(conn, "customers")] == [v2]
    verified = deployment.model_copy(update={"deploy_verify": True})
    deployer = Deployer(spark, verified, [UPPER])
    assert deployer.build(UPPER) is True
    assert deployer.reports["customers"].restored == v2
    assert customer_names(deployment) == {"ADA", "BO", "CY", "DI", "ED"}
    with psycopg.connect(deployment.database()) as conn:
        assert [k.version for k in keeping.kept(conn, "customers")] == [v1]
        [changes] = conn.execute(
            "SELECT build_report FROM projection_progress WHERE projection = 'customers'"
        ).fetchone()
    # Every row's name changed: each was only in the old version, and is only in the new.
    assert changes["tables"] == {"customers": {"only_in_old": 5, "only_in_new": 5}}

    # A later projector's build supersedes this one: the last asked for is swapped in.
    with psycopg.connect(deployment.database()) as conn:
        conn.execute(
            "UPDATE projection_progress SET building_version = 'later' "
            "WHERE projection = 'customers'"
        )
    job = Rebuild(deployment, spark)
    job.building = "earlier"
    with pytest.raises(RuntimeError, match="superseded"):
        job.run(customers_with(upper_rows, version="earlier"), progress=False)
    assert live_version_of(deployment)[:2] == (versions.of(UPPER), "later")
    assert customer_names(deployment) == {"ADA", "BO", "CY", "DI", "ED"}

    # A build that fails leaves the live version serving, and says why.
    broken = customers_with(always_broken_rows, version="broken")
    projector = Projector(deployment, spark, projections=(broken,), joins=())
    assert projector.deployer.build(broken) is False
    version, building, error = live_version_of(deployment)
    assert version == versions.of(UPPER) and building is None
    assert "broken for every event" in error
    assert customer_names(deployment) == {"ADA", "BO", "CY", "DI", "ED"}
    app = create_app(deployment)
    try:
        client = app.test_client()
        component = health_component(
            client, "projection:customers", lambda c: "build_error" in c, ADMIN
        )
        assert component["status"] == "up" and "broken" in component["build_error"]
        public = client.get("/health").json["components"]["projection:customers"]
        assert "build_error" not in public and public["version"] == versions.of(UPPER)
    finally:
        close_app(app)


def test_a_projection_failing_on_an_old_schema_event_parks_it(
    base_settings: Settings, spark: Any
) -> None:
    """The event that breaks a projection is at an older schema version, so its rows fail
    only when the batch's old events are upcast: it parks, found as a poison event in the
    batch's own rows is, and the others go on; a retry applies it upcast once fixed."""
    deployment = new_deployment(base_settings)
    legacy = f"legacy-{uuid.uuid4().hex[:10]}"
    poisoned = v1_customer_registered(legacy)
    poisoned["data"]["full_name"] = POISON
    produce_raw(deployment, legacy, json.dumps(poisoned).encode())
    order = place(deployment)
    projector = run_events(deployment, spark, (BROKEN, orders.projection))
    try:
        wait_until(lambda: len(parked(deployment)) == 1, 120, "the old event parked")
        assert parked(deployment)[0][0] == legacy
        assert "deliberately broken" in parked(deployment)[0][1]
        wait_until(lambda: order in order_ids(deployment), 120, "the order beside it")
        assert POISON not in customer_names(deployment)
        assert failure(deployment) == (None, None)
        assert projector.queries["events"].isActive
    finally:
        stop(projector)
    # The real projection folds the event in its upcast form once retried.
    projector = run_events(deployment, spark, (customers.projection, orders.projection))
    try:
        assert retry(deployment, projector) == 1
        assert POISON in customer_names(deployment)
        assert parked(deployment) == []
    finally:
        stop(projector)


def test_old_schema_events_are_folded_upcast_in_a_batch_with_current_ones(
    deployment: Settings, spark: Any
) -> None:
    legacy = f"legacy-{uuid.uuid4().hex[:10]}"
    produce_raw(deployment, legacy, json.dumps(v1_customer_registered(legacy)).encode())
    current = register(deployment, "Linus")
    projector = run_events(deployment, spark, (customers.projection,))
    try:
        wait_until(
            lambda: {"Grace Hopper", "Linus"} <= customer_names(deployment), 120, "both customers"
        )
    finally:
        stop(projector)
    with psycopg.connect(deployment.database()) as conn:
        rows = dict(
            conn.execute(
                "SELECT customer_id, email FROM customers WHERE customer_id = ANY(%s)",
                ([legacy, current],),
            ).fetchall()
        )
    assert rows == {legacy: "grace@example.com", current: f"{current}@x.org"}


def append_a_paid_order(settings: Settings) -> None:
    """Customer c-1 registered, book b-1 added, and order o-1 of two copies placed and paid."""
    line = PlacedLine("b-1", 2, 900, "Le Guin", 0.1)
    append_events(settings, "customer", "c-1", (1, CustomerRegistered("Ursula", "u@x.org"), AT))
    append_events(
        settings, "book", "b-1", (1, BookAdded("The Dispossessed", "Le Guin", 900, 0.1), AT)
    )
    placed, paid = OrderPlaced("c-1", (line,), 1800), OrderPaid(1800, (line,))
    append_events(settings, "order", "o-1", (1, placed, AT), (2, paid, AT))


def test_a_rebuild_folds_old_schema_events_upcast_beside_current_ones(
    base_settings: Settings, spark: Any
) -> None:
    """A rebuild decodes the whole log in Spark once; the records at an older schema version
    go through the upcasters and every view, those reading an order's paid lines too, comes
    out as the fold of the upcast log."""
    from spark.rebuild import Rebuild

    settings = new_deployment(base_settings)
    legacy = f"legacy-{uuid.uuid4().hex[:10]}"
    produce_raw(settings, legacy, json.dumps(v1_customer_registered(legacy)).encode())
    append_a_paid_order(settings)

    Rebuild(settings, spark).run_many(list(PROJECTIONS.values()), progress=False)

    assert differences(settings) == {}
    with psycopg.connect(settings.database()) as conn:
        emails = dict(conn.execute("SELECT customer_id, email FROM customers").fetchall())
        royalties = conn.execute("SELECT author, units_sold FROM author_royalties").fetchall()
    assert emails == {legacy: "grace@example.com", "c-1": "u@x.org"}
    assert royalties == [("Le Guin", 2)]


def test_a_rebuild_run_again_in_the_same_process_compiles_no_new_code(
    base_settings: Settings, spark: Any
) -> None:
    """Spark keeps the classes it generated for a rebuild's plans: the same rebuild again (as a
    long-lived process or the benchmark runs it) compiles none, where a cache smaller than a
    rebuild's classes made every rebuild compile all of them again."""
    from spark.rebuild import Rebuild

    settings = new_deployment(base_settings)
    append_a_paid_order(settings)
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    rebuild = Rebuild(settings, spark)

    rebuild.run_many(list(PROJECTIONS.values()), progress=False)
    first = compiled.getCount()
    rebuild.run_many(list(PROJECTIONS.values()), progress=False)

    assert compiled.getCount() == first
    assert differences(settings) == {}


def test_a_rehearsed_rebuild_folds_the_first_records_of_each_partition_and_writes_nothing(
    base_settings: Settings, spark: Any
) -> None:
    """Once started, a projector rehearses a rebuild (`Rebuild.rehearse`), so that the first
    `logfold rebuild` handed to it runs in code already generated and compiled: every folded
    output of the first records of each partition goes to Python as a load sends it, and is
    counted; nothing is written anywhere."""
    from spark.rebuild import Rebuild

    settings = new_deployment(base_settings)
    append_a_paid_order(settings)  # c-1, b-1, o-1: every fold has an event to fold
    on_zero = []
    while len(on_zero) < 3:
        cid = f"c-{uuid.uuid4().hex[:8]}"
        if cid != "c-1" and partition_for(cid, settings.partitions) == 0:
            event = (1, CustomerRegistered(cid, f"{cid}@x.org"), AT)
            append_events(settings, "customer", cid, event)
            on_zero.append(cid)
    zero_first = 1 if partition_for("c-1", settings.partitions) == 0 else 0

    def everything() -> dict[str, list[Any]]:
        with psycopg.connect(settings.database()) as conn:
            tables = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
            ).fetchall()
            return {
                t: sorted(map(repr, conn.execute(f'SELECT * FROM "{t}"').fetchall()))
                for (t,) in tables
            }

    before = everything()
    rebuild = Rebuild(settings, spark)
    # 2 records in equal shares of the customers' partitions that hold any: one each.
    held = 1 + (1 - zero_first)
    assert rebuild.rehearse([customers.projection], held) == held
    # Enough for every record of partition 0 (offsets, commit markers among them): all four.
    assert rebuild.rehearse([customers.projection], 100) == 4
    assert rebuild.rehearse(list(PROJECTIONS.values()), 100) > 4  # every fold ran, none failed
    assert everything() == before


def test_records_deleted_from_the_log_before_they_were_applied_are_reported(
    base_settings: Settings, spark: Any
) -> None:
    """Spark reads with failOnDataLoss=false (transaction markers are not losses); records that
    were deleted before a projection applied them are still found, logged and shown."""
    settings = new_deployment(base_settings)
    topic = Topics(settings.topic_prefix).events("customer")

    def on_partition_0(name: str) -> str:
        while True:
            cid = f"c-{uuid.uuid4().hex[:8]}"
            if partition_for(cid, settings.partitions) == 0:
                event = (1, CustomerRegistered(name, f"{cid}@x.org"), AT)
                append_events(settings, "customer", cid, event, transactional=False)
                return cid

    for name in ("A", "B"):
        on_partition_0(name)  # offsets 0, 1
    projector = run_events(settings, spark, (customers.projection,))
    try:
        wait_until(lambda: customer_names(settings) == {"A", "B"}, 120, "A and B")
    finally:
        stop(projector)

    for name in ("Gone1", "Gone2", "Kept"):
        on_partition_0(name)  # offsets 2, 3, 4
    # a retention set by mistake (or an operator) deletes 2 and 3 before they are applied
    delete_records(settings, topic, 4)

    projector = run_events(settings, spark, (customers.projection,))
    app = create_app(settings)
    try:
        wait_until(lambda: "Kept" in customer_names(settings), 120, "Kept")
        assert customer_names(settings) == {"A", "B", "Kept"}
        component = health_component(
            app.test_client(), "projection:customers", lambda c: c["lost_offsets"] > 0
        )
        assert component["lost_offsets"] == 2
        [loss] = component["data_loss"]
        assert (loss["partition"], loss["from_offset"], loss["to_offset"]) == (f"{topic}:0", 2, 3)
        metrics = app.test_client().get("/metrics", headers=ADMIN).get_data(as_text=True)
        assert 'logfold_lost_offsets{component="projection:customers"} 2.0' in metrics
    finally:
        close_app(app)
        stop(projector)


def running_live(settings: Settings, spark: Any, projections: tuple[Projection, ...]) -> Any:
    """The event pipeline of `projections`, in real-time mode, once its query runs."""
    from spark.realtime import RealTimeEvents

    with psycopg.connect(settings.database()) as conn:
        since = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    projector = run_events(settings, spark, projections)
    live = projector.queries["events"]
    assert isinstance(live, RealTimeEvents), "the projector's Spark has the slots it needs"

    def running() -> bool:
        assert live.isActive, live.exception()
        with psycopg.connect(settings.database()) as conn:
            row = conn.execute(
                "SELECT count(*) FROM projection_progress WHERE started_at >= %s "
                "AND projection = ANY(%s)",
                (since, [p.name for p in projections]),
            ).fetchone()
        return row is not None and row[0] == len(projections)

    wait_until(running, 120, "the real-time query")
    return projector


def on_partition(settings: Settings, partition: int, name: str) -> str:
    """Register a customer called `name` whose events go to `partition`."""
    while True:
        cid = f"c-{uuid.uuid4().hex[:8]}"
        if partition_for(cid, settings.partitions) == partition:
            append_events(settings, "customer", cid, (1, CustomerRegistered(name, f"{cid}@x"), AT))
            return cid


def test_rows_delivered_twice_or_left_by_a_stopped_query_change_nothing(
    base_settings: Settings, spark: Any
) -> None:
    """Real-time mode delivers at least once (a retried task starts again from its epoch's
    first offsets), and a stopped query's rows may still be in flight: rows of events a
    projection applied change nothing, and rows of another query start are not applied."""

    settings = new_deployment(base_settings)
    rows_topic = Topics(settings.topic_prefix).projector_rows
    projector = running_live(settings, spark, (customers.projection,))
    try:
        on_partition(settings, 0, "Ada")
        wait_until(lambda: customer_names(settings) == {"Ada"}, 120, "Ada")
        (ada,) = [r for r in topic_records(settings, rows_topic) if b"Ada" in r.value]
        replayed = json.loads(ada.value)
        stale = {**replayed, "g": "another-start", "2": replayed["2"] + 2}
        stale["7"] = replayed["7"].replace("Ada", "Mallory")
        send_again(settings, ada, replayed, stale)
        # Bob's rows follow those two in the same rows partition (the same key), so once he
        # is in, they were read.
        on_partition(settings, 0, "Bob")
        wait_until(lambda: "Bob" in customer_names(settings), 120, "Bob")
        assert customer_names(settings) == {"Ada", "Bob"}
        with psycopg.connect(settings.database()) as conn:
            row = conn.execute(
                "SELECT events_applied FROM projection_progress WHERE projection = 'customers'"
            ).fetchone()
        assert row is not None and row[0] == 2  # each event once
        assert "customers" not in differences(settings)  # the other views are not folded here
    finally:
        stop(projector)


def test_an_old_schema_event_arriving_live_is_folded_upcast(
    base_settings: Settings, spark: Any
) -> None:
    settings = new_deployment(base_settings)
    projector = running_live(settings, spark, (customers.projection,))
    try:
        legacy = f"legacy-{uuid.uuid4().hex[:10]}"
        produce_raw(settings, legacy, json.dumps(v1_customer_registered(legacy)).encode())
        register(settings, "Linus")
        wait_until(
            lambda: {"Grace Hopper", "Linus"} <= customer_names(settings), 120, "both customers"
        )
        live = projector.queries["events"]
        assert live.upcast_polls >= 1 and live.isActive  # upcast in place, not by a restart
    finally:
        stop(projector)


def test_without_real_time_mode_the_pipeline_folds_in_micro_batches(
    base_settings: Settings, spark: Any
) -> None:
    settings = new_deployment(base_settings, spark_realtime=False)
    projector = run_events(settings, spark, (customers.projection,))
    try:
        assert projector.queries["events"].name == "events"  # a StreamingQuery of its own
        register(settings, "Ken")
        wait_until(lambda: customer_names(settings) == {"Ken"}, 120, "Ken")
    finally:
        stop(projector)
