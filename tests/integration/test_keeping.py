"""Earlier versions of a projection kept for a rollback (spark/keeping.py), a build's progress
as `logfold projections` shows it, and an erasure reaching the copies outside a view
(spark/erasure.py), on real Postgres (the builds that use them run on Spark in
test_event_pipeline.py, the whole erasure in test_live_joins.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from config.settings import Settings
from events.base import ERASED
from spark import keeping
from spark.deploy import build_progress
from spark.rebuild import ProgressWriter
from stack import cli
from stack.procs import wait_until
from tests.support import cli_env, tables_holding

pytestmark = pytest.mark.integration


def _live(settings: Settings, version: str, names: list[str]) -> None:
    with psycopg.connect(settings.database()) as conn:
        conn.execute(
            "INSERT INTO projection_progress (projection, version, offsets) "
            "VALUES ('customers', %s, '{\"t:0\": 7}') ON CONFLICT (projection) "
            "DO UPDATE SET version = excluded.version, offsets = excluded.offsets",
            (version,),
        )
        conn.execute("DELETE FROM customers")
        for i, name in enumerate(names):
            conn.execute(
                "INSERT INTO customers (customer_id, name, email, registered_at) "
                "VALUES (%s, %s, %s, now())",
                (f"c{i}", name, f"{i}@example.com"),
            )


def _park(conn: psycopg.Connection[Any], table: str, offset: int) -> None:
    extra = ", reason" if table == "skipped_events" else ""
    conn.execute(
        f'INSERT INTO {table} (projection, topic, partition, "offset", aggregate, error{extra}) '
        f"VALUES ('customers', 't', 0, %s, 'c0', 'broken'{', %s' if extra else ''})",
        (offset, "on purpose") if extra else (offset,),
    )


def test_a_version_is_kept_at_one_position_and_only_the_newest_are_kept(fresh: Settings) -> None:
    _live(fresh, "v1", ["Ada", "Bo"])
    kept = keeping.keep(fresh.database(), "customers", ["customers"], streams=False)
    assert kept is not None and kept.version == "v1" and kept.offsets == {"t:0": 7}
    _live(fresh, "v2", ["ADA"])  # v2 swapped in
    with psycopg.connect(fresh.database()) as conn:
        [copy] = kept.tables.values()
        assert {r[0] for r in conn.execute(f"SELECT name FROM {copy}")} == {"Ada", "Bo"}
        assert keeping.usable(conn, "customers", "v1") == kept
        assert keeping.usable(conn, "customers", "v2") is None
    assert keeping.keep(fresh.database(), "customers", ["customers"], streams=False)
    _live(fresh, "v3", ["A"])
    with psycopg.connect(fresh.database()) as conn:
        # One kept by default: the newest (v2); v1's copy is dropped with its record.
        assert keeping.prune(conn, "customers", fresh.keep_versions) == ["v1"]
        assert [k.version for k in keeping.kept(conn)] == ["v2"]
        assert conn.execute("SELECT to_regclass(%s)", (copy,)).fetchone() == (None,)
        # The live version's own copy is stale once it is live again: dropped.
        conn.execute("UPDATE projection_progress SET version = 'v2'")
        assert keeping.prune(conn, "customers", 5) == ["v2"]
        assert keeping.kept(conn) == []


def test_a_version_with_parked_events_is_not_kept_and_a_skip_makes_a_copy_unusable(
    fresh: Settings,
) -> None:
    _live(fresh, "v1", ["Ada"])
    with psycopg.connect(fresh.database()) as conn:
        _park(conn, "parked_events", 3)
    # Its rows lack what is parked, which the swap clears: a copy would not be the fold.
    assert keeping.keep(fresh.database(), "customers", ["customers"], streams=False) is None
    with psycopg.connect(fresh.database()) as conn:
        conn.execute("DELETE FROM parked_events")
    assert keeping.keep(fresh.database(), "customers", ["customers"], streams=False)
    with psycopg.connect(fresh.database()) as conn:
        conn.execute("UPDATE projection_progress SET version = 'v2'")
        assert keeping.usable(conn, "customers", "v1") is not None
        # A later skip: a rebuild of v1 would leave that event out; the copy has it.
        _park(conn, "skipped_events", 4)
        assert keeping.usable(conn, "customers", "v1") is None


class _Job:
    """What `ProgressWriter` reads of a build: its progress bar."""

    def __init__(self) -> None:
        self.bar: Any = type("Bar", (), {"n": 50, "total": 200})()
        self.bar_out: Any = None


def test_a_builds_progress_is_recorded_and_drawn_by_logfold_projections(
    fresh: Settings, tmp_path: Path
) -> None:
    _live(fresh, "v1", ["Ada"])
    with psycopg.connect(fresh.database()) as conn:
        conn.execute(
            "UPDATE projection_progress SET building_version = 'v2', build_started_at = now()"
        )

    def recorded() -> Any:
        with psycopg.connect(fresh.database()) as conn:
            return conn.execute(
                "SELECT build_done, build_total FROM projection_progress"
            ).fetchone()

    job: Any = _Job()
    with ProgressWriter(fresh.database(), job, build_progress("customers")):
        wait_until(lambda: recorded() == (50, 200), 30, "the build's progress recorded")
    env = cli_env(fresh, tmp_path)
    listed = CliRunner().invoke(cli.main, ["projections"], env=env)
    assert listed.exit_code == 0, listed.output
    [line] = [x for x in listed.output.splitlines() if x.startswith("customers ")]
    assert "building v2" in line and "50/200" in line and "25%" in line

    # --watch draws it until the build is over (here: swapped in by someone else).
    watched: list[Any] = []
    watcher = threading.Thread(
        target=lambda: watched.append(
            CliRunner().invoke(cli.main, ["projections", "--watch"], env=env)
        )
    )
    watcher.start()
    with psycopg.connect(fresh.database()) as conn:
        conn.execute("UPDATE projection_progress SET building_version = NULL, version = 'v2'")
    watcher.join(timeout=60)
    assert not watcher.is_alive()
    assert watched[0].exit_code == 0, watched[0].output
    [line] = [x for x in watched[0].output.splitlines() if x.startswith("customers ")]
    assert line.split()[2] == "v2"


def test_an_erasure_reaches_the_kept_copies_and_the_webhooks_dead_letters(fresh: Settings) -> None:
    """Guarantee 27, for the copies CDC does not reach: a batch that erases a customer erases
    it in the kept versions of the view and in the bodies of webhook dead letters."""
    from projections import customers
    from spark.sink import merge_json

    name, email = "Ada Lovelace", "0@example.com"
    _live(fresh, "v1", [name, "Bo"])
    assert keeping.keep(fresh.database(), "customers", ["customers"], streams=False)
    body = json.dumps(
        {"type": "change", "row": {"customer_id": "c0", "name": name, "email": email}}
    )
    with psycopg.connect(fresh.database()) as conn:
        conn.execute(
            "INSERT INTO webhook_endpoints (id, url, view, secret, cursor) "
            "VALUES ('e1', 'https://example.com/hook', 'customers', 's', 0)"
        )
        conn.execute(
            'INSERT INTO webhook_dead_letters (message_id, endpoint_id, "offset", position, key, '
            "body, attempts, last_error, first_attempt_at, failed_at) "
            "VALUES ('m1', 'e1', 0, '1.1', %s, %s, 3, '500', now(), now())",
            ('{"customer_id": "c0"}', body),
        )
    assert set(tables_holding(fresh, name, email)) == {
        "customers",
        "customers__kept_" + keeping._digest("v1"),
        "webhook_dead_letters",
    }
    erased = [{"customer_id": "c0", "name": ERASED, "email": ERASED, "version": 9}]
    with psycopg.connect(fresh.database()) as conn:
        merge_json(conn, customers.output, json.dumps(erased))
    assert tables_holding(fresh, name, email) == {}
    assert tables_holding(fresh, "Bo") != {}  # the others' rows untouched
    with psycopg.connect(fresh.database()) as conn:
        [sent] = conn.execute("SELECT body FROM webhook_dead_letters").fetchone() or [None]
    assert json.loads(sent)["row"] == {"customer_id": "c0", "name": ERASED, "email": ERASED}
