"""The API's database login (a member of `logfold_reader`, made by `logfold migrate` as
docker-compose.yml's migrate service makes it) reads exactly the views the API serves and what
/health and read-your-writes need (migration 0012). The folds' own state holds customer ids no
view shows, and other sessions' query texts are not its business: it reads neither."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from click.testing import CliRunner

from app.health import HealthChecks
from app.read_model import ReadModel
from config.settings import Settings, slot_name
from projections.base.progress import table as progress
from projections.registry import VIEWS
from stack import cli
from tests.support import new_deployment

pytestmark = pytest.mark.integration

SERVED = {*VIEWS, str(progress.name), "projector_status", "parked_events", "skipped_events"}
# Tables of the folds' own state: customer ids and fields that no view shows.
STATE = {"join_state", "stream_ids", "conversion_views", "conversion_orders"}
# The webhook endpoints the API registers (through `logfold_webhooks`, migration 0013).
WEBHOOKS = {"webhook_endpoints", "webhook_dead_letters"}


@pytest.fixture(scope="module")
def deployment(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A migrated deployment whose `api_database_url` is a login `logfold migrate` made."""
    deployment = new_deployment(base_settings)
    role = f"api_{uuid.uuid4().hex[:10]}"
    owner = urlsplit(deployment.database())
    url = f"postgresql://{role}:{secrets.token_hex(12)}@{owner.netloc.split('@')[1]}{owner.path}"
    env = {
        "DATABASE_URL": deployment.database(),
        "LOGFOLD_API_DATABASE_URL": url,
        "LOGFOLD_HOME": str(tmp_path_factory.mktemp("home")),  # no local stack's settings
    }
    done = CliRunner().invoke(cli.main, ["migrate"], env=env)
    assert done.exit_code == 0, done.output
    assert f"the API logs in as {role}" in done.output
    return deployment.model_copy(update={"api_database_url": url})


@pytest.fixture
def reader(deployment: Settings) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    assert deployment.api_database_url is not None
    with psycopg.connect(deployment.api_database_url, autocommit=True) as conn:
        yield conn


def tables(deployment: Settings) -> set[str]:
    with psycopg.connect(deployment.database()) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {str(name) for (name,) in rows}


def test_the_login_reads_every_view_the_api_serves_and_the_progress(
    reader: psycopg.Connection[tuple[object, ...]],
) -> None:
    for table in sorted(SERVED):
        assert reader.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table


def test_the_login_reads_no_other_table_now_or_later(
    deployment: Settings, reader: psycopg.Connection[tuple[object, ...]]
) -> None:
    with psycopg.connect(deployment.database(), autocommit=True) as owner:
        owner.execute("CREATE TABLE customers__rebuild (LIKE customers)")  # a rebuild's shadow
    others = tables(deployment) - SERVED - WEBHOOKS
    assert STATE | {"customers__rebuild", "author_profiles"} <= others, others
    for table in sorted(others):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(f"SELECT 1 FROM {table} LIMIT 1")
    for statement in (
        "INSERT INTO projection_progress (projection) VALUES ('x')",
        "DELETE FROM customers",
        "CREATE TABLE mine (x int)",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(statement)


def test_the_login_writes_the_webhook_tables_and_no_other(
    reader: psycopg.Connection[tuple[object, ...]],
) -> None:
    reader.execute(
        "INSERT INTO webhook_endpoints (id, url, view, secret, cursor) "
        "VALUES ('ep_t', 'https://example.com/', 'customers', 'whsec_x', 0)"
    )
    reader.execute("UPDATE webhook_endpoints SET status = 'paused' WHERE id = 'ep_t'")
    assert reader.execute("SELECT count(*) FROM webhook_dead_letters").fetchone() == (0,)
    assert reader.execute("DELETE FROM webhook_endpoints WHERE id = 'ep_t'").rowcount == 1
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reader.execute("INSERT INTO customers (customer_id) VALUES ('x')")


def test_the_login_asks_for_retries_and_skips_of_parked_events_and_nothing_more(
    deployment: Settings, reader: psycopg.Connection[tuple[object, ...]]
) -> None:
    """`/dead-letters` marks parked events (the projector carries retries and skips out): the
    login may set those marks, and not park, unpark or rewrite an event."""
    with psycopg.connect(deployment.database(), autocommit=True) as owner:
        owner.execute(
            'INSERT INTO parked_events (projection, topic, partition, "offset", aggregate, error) '
            "VALUES ('customers', 't', 0, 7, 'c-1', 'broken') ON CONFLICT DO NOTHING"
        )
    marked = reader.execute(
        "UPDATE parked_events SET retry_requested_at = now(), skip_reason = 'why' "
        "WHERE aggregate = 'c-1'"
    )
    assert marked.rowcount == 1
    for statement in (
        "UPDATE parked_events SET error = 'x'",
        "DELETE FROM parked_events",
        'INSERT INTO skipped_events (projection, topic, partition, "offset", aggregate, '
        "error, reason) VALUES ('customers', 't', 0, 8, 'c-1', 'e', 'r')",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(statement)


def test_the_login_sees_no_other_sessions_queries(
    deployment: Settings, reader: psycopg.Connection[tuple[object, ...]]
) -> None:
    for role in ("pg_monitor", "pg_read_all_stats", "pg_read_all_data"):
        found = reader.execute("SELECT pg_has_role(current_user, %s, 'USAGE')", (role,))
        assert found.fetchone() == (False,), role
    with psycopg.connect(deployment.database(), autocommit=True) as owner:
        owner.execute("SELECT 'a query naming customer c-42'")
        pid = owner.info.backend_pid
        [(query,)] = reader.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchall()
    assert query == "<insufficient privilege>"


def test_the_login_reads_what_health_and_read_your_writes_need(
    deployment: Settings, reader: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The replication slot (pg_replication_slots, readable by every role), CDC's flush lag
    through the one function granted for it, the progress and counts of every fold."""
    slot = slot_name(deployment)
    before = reader.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert before is not None
    with psycopg.connect(deployment.database(), autocommit=True) as owner:
        owner.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    model = ReadModel(deployment)
    try:
        # The API given its own login only, as docker-compose.yml gives it.
        api_only = deployment.model_copy(update={"database_url": None})
        checks = HealthChecks(api_only, model)
        cdc = checks.cdc()
        assert cdc["slot"] == slot and cdc["wal_status"] == "reserved", cdc
        assert cdc["lag_seconds"] == 0.0 and "error" not in cdc, cdc
        assert checks.postgres() == {"status": "up"}
        projections = checks.projections()
        assert set(projections) == set(model.lag()) and projections, projections
        assert all(p["status"] == "up" for p in projections.values()), projections
        # read-your-writes across a join waits for CDC to confirm a WAL position
        confirmed = reader.execute(
            "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (before[0], slot),
        ).fetchone()
        assert confirmed == (True,)  # the slot starts after it
        found = reader.execute("SELECT logfold_slot_flush_lag(%s)", (slot,)).fetchone()
        assert found == (None,)  # no CDC process attached
        granted = reader.execute(
            "SELECT has_function_privilege('public', 'logfold_slot_flush_lag(name)', 'EXECUTE')"
        ).fetchone()
        assert granted == (False,)  # the reader's alone
    finally:
        model.close()
        with psycopg.connect(deployment.database(), autocommit=True) as owner:
            owner.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_migrate_refuses_to_make_the_owner_the_apis_login(
    deployment: Settings, tmp_path: Path
) -> None:
    env = {
        "DATABASE_URL": deployment.database(),
        "LOGFOLD_API_DATABASE_URL": deployment.database(),
        "LOGFOLD_HOME": str(tmp_path),
    }
    done = CliRunner().invoke(cli.main, ["migrate"], env=env)
    assert done.exit_code == 1 and "the owner of the tables" in done.output, done.output
