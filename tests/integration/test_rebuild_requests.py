"""`logfold rebuild` and the running projector, on real Postgres: the command hands the rebuild
to a projector that beats and folds the same versions, follows it to its reports, and rebuilds
in a driver of its own when none takes it in time or the one that took it goes silent. The
projector's side is played here by a thread doing what `spark/rebuilder.py` does with the
requests (the rebuild itself, in a real projector, is `test_projector.py`'s rebuild while
commands flow)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import psycopg
import pytest
from click.testing import CliRunner, Result

from config.settings import Settings
from projections.base import rebuilds
from projections.registry import JOINS, PROJECTIONS
from stack import cli as cli_module
from tests.support import cli_env, free_port, new_deployment

CUSTOMERS = rebuilds.versions_of([PROJECTIONS["customers"]], [])
REPORT = {
    "projection": "customers",
    "events": 7,
    "seconds": 0.5,
    "rows": {"customers": 3},
    "differences": {"customers": []},
    "parked_aggregates": 0,
    "skipped_events": 0,
}


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    return new_deployment(base_settings)


@pytest.fixture
def settings(deployment: Settings) -> Settings:
    """The module's deployment, with no request and no projector's status."""
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute("DELETE FROM rebuild_requests")
        conn.execute("DELETE FROM projector_status")
    return deployment


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """What the command rebuilt in a driver of its own (none is started here)."""
    ran: list[tuple[str, ...]] = []

    def rebuild_here(settings: Settings, chosen: tuple[str, ...], verify: bool) -> list[Any]:
        ran.append(chosen)
        return []

    monkeypatch.setattr(cli_module, "_rebuild_here", rebuild_here)
    monkeypatch.setattr(cli_module, "CLAIM_S", 1.0)
    monkeypatch.setattr(cli_module, "SILENT_S", 2.0)
    return ran


@pytest.fixture
def rebuild(settings: Settings, tmp_path: Any) -> Callable[..., Result]:
    """`logfold rebuild <args>`, run here to its end."""

    def run(*args: str) -> Result:
        env = cli_env(settings, tmp_path)
        return CliRunner().invoke(cli_module.main, ["rebuild", *args], env=env)

    return run


def projector_beats(settings: Settings, seconds_ago: float = 0.0) -> None:
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO projector_status (name, master, executors, slots, slots_needed, beat_at) "
            "VALUES ('projector', 'local[2]', 1, 2, 0, now() - make_interval(secs => %s))",
            (seconds_ago,),
        )


def requests(settings: Settings) -> list[tuple[Any, ...]]:
    with psycopg.connect(settings.database()) as conn:
        return conn.execute(
            "SELECT projections, verify, claimed_by, finished_at IS NOT NULL, error "
            "FROM rebuild_requests ORDER BY id"
        ).fetchall()


@pytest.fixture
def projector(settings: Settings) -> Iterator[Callable[..., None]]:
    """Starts a stand-in for a running projector (its status row beating) and its request
    thread: claims what matches `mine`, beats `beats` times, then finishes with `reports` or
    `error` (or goes silent)."""
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def start(
        mine: dict[str, str],
        beats: int = 2,
        reports: list[dict[str, Any]] | None = None,
        error: str | None = None,
        silent: bool = False,
    ) -> None:
        projector_beats(settings)

        def run() -> None:
            with psycopg.connect(settings.database(), autocommit=True) as conn:
                while not stop.is_set():
                    request = rebuilds.claim(conn, mine, "test-host:4242")
                    if request is not None:
                        break
                    stop.wait(0.05)
                else:
                    return
                for n in range(beats):
                    rebuilds.beat(conn, request.id, n, beats)
                    stop.wait(0.2)
                if not silent:
                    rebuilds.finish(conn, request.id, reports, error)

        threads.append(threading.Thread(target=run))
        threads[-1].start()

    yield start
    stop.set()
    for t in threads:
        t.join(timeout=10)


def test_with_no_projector_running_the_command_rebuilds_itself_and_asks_nothing(
    settings: Settings, here: list[tuple[str, ...]], rebuild: Callable[..., Result]
) -> None:
    done = rebuild("customers")
    assert done.exit_code == 0, done.output
    assert here == [("customers",)]
    assert requests(settings) == []


def test_a_projector_that_stopped_beating_is_not_asked(
    settings: Settings, here: list[tuple[str, ...]], rebuild: Callable[..., Result]
) -> None:
    projector_beats(settings, seconds_ago=60)
    done = rebuild("customers")
    assert done.exit_code == 0, done.output
    assert here == [("customers",)]
    assert requests(settings) == []


def test_the_running_projector_rebuilds_and_the_command_prints_its_reports(
    settings: Settings,
    here: list[tuple[str, ...]],
    projector: Callable[..., None],
    rebuild: Callable[..., Result],
) -> None:
    projector(CUSTOMERS, reports=[REPORT])
    done = rebuild("customers", "--verify")
    assert done.exit_code == 0, done.output
    assert here == [], "rebuilt by the command too"
    assert "the running projector (test-host:4242) is rebuilding" in done.output
    assert "customers: 7 events in 0.5s" in done.output
    assert "verify customers: identical to the live view" in done.output
    assert requests(settings) == [(CUSTOMERS, True, "test-host:4242", True, None)]


def test_differences_the_projector_found_exit_1(
    settings: Settings,
    here: list[tuple[str, ...]],
    projector: Callable[..., None],
    rebuild: Callable[..., Result],
) -> None:
    found = REPORT | {"differences": {"customers": [["only_in_live", "c-1", "Ann"]]}}
    projector(CUSTOMERS, reports=[found])
    done = rebuild("customers", "--verify")
    assert done.exit_code == 1, done.output
    assert "verify customers: 1 differences" in done.output
    assert "('only_in_live', 'c-1', 'Ann')" in done.output
    assert here == []


def test_a_projector_folding_other_versions_leaves_the_request_and_the_command_rebuilds_itself(
    settings: Settings,
    here: list[tuple[str, ...]],
    projector: Callable[..., None],
    rebuild: Callable[..., Result],
) -> None:
    projector({"customers": "another-version", **{n: "x" for n in JOINS}})
    done = rebuild("customers")
    assert done.exit_code == 0, done.output
    assert "did not take the rebuild" in done.output
    assert here == [("customers",)]
    assert requests(settings) == [], "the request was not withdrawn"


def test_a_projector_that_goes_silent_mid_rebuild_is_taken_for_gone(
    settings: Settings,
    here: list[tuple[str, ...]],
    projector: Callable[..., None],
    rebuild: Callable[..., Result],
) -> None:
    projector(CUSTOMERS, silent=True)
    done = rebuild("customers")
    assert done.exit_code == 0, done.output
    assert "went silent mid-rebuild; rebuilding here" in done.output
    assert here == [("customers",)]
    assert requests(settings) == [
        (CUSTOMERS, False, "test-host:4242", True, "its projector went silent")
    ]


def test_a_rebuild_the_projector_could_not_do_exits_1_with_its_error(
    settings: Settings,
    here: list[tuple[str, ...]],
    projector: Callable[..., None],
    rebuild: Callable[..., Result],
) -> None:
    projector(CUSTOMERS, error="Py4JJavaError: out of memory")
    done = rebuild("customers")
    assert done.exit_code == 1, done.output
    assert "could not rebuild: Py4JJavaError: out of memory" in done.output
    assert here == []


def test_a_claim_takes_the_oldest_request_whose_every_version_matches(settings: Settings) -> None:
    every = rebuilds.versions_of(PROJECTIONS.values(), JOINS.values())
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        other = rebuilds.ask(conn, {"customers": "older"}, verify=False)
        first = rebuilds.ask(conn, CUSTOMERS, verify=True)
        second = rebuilds.ask(conn, every, verify=False)
        claimed = rebuilds.claim(conn, every, "a:1")
        assert claimed == rebuilds.Request(first, CUSTOMERS, True)
        assert rebuilds.claim(conn, every, "b:2") == rebuilds.Request(second, every, False)
        assert rebuilds.claim(conn, every, "c:3") is None  # the other version's is left
        assert not rebuilds.withdraw(conn, first)  # claimed: stays
        assert rebuilds.withdraw(conn, other)
    assert [r[2] for r in requests(settings)] == ["a:1", "b:2"]


def test_logfold_projections_lists_the_rebuilds_asked_and_not_finished(
    settings: Settings, tmp_path: Any
) -> None:
    every = rebuilds.versions_of(PROJECTIONS.values(), JOINS.values())
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        waiting = rebuilds.ask(conn, {"customers": "another-version"}, verify=False)
        taken = rebuilds.ask(conn, every, verify=True)
        assert rebuilds.claim(conn, every, "host-b:7") is not None
        rebuilds.beat(conn, taken, 250, 1000)
        done = rebuilds.ask(conn, CUSTOMERS, verify=False)
        rebuilds.finish(conn, done, [])
    listed = CliRunner().invoke(cli_module.main, ["projections"], env=cli_env(settings, tmp_path))
    assert listed.exit_code == 0, listed.output
    assert f"rebuild {waiting} (customers): waiting for a projector to take it" in listed.output
    assert f"rebuild {taken} (" in listed.output
    assert "by the projector host-b:7" in listed.output and "250/1000" in listed.output
    assert f"rebuild {done} " not in listed.output


def test_postgres_out_of_reach_is_said_and_exits_2(
    settings: Settings, here: list[tuple[str, ...]], tmp_path: Any
) -> None:
    away = settings.model_copy(
        update={"database_url": f"postgresql://logfold@127.0.0.1:{free_port()}/nowhere"}
    )
    done = CliRunner().invoke(
        cli_module.main, ["rebuild", "customers"], env=cli_env(away, tmp_path)
    )
    assert done.exit_code == 2, done.output
    assert "error: Postgres is out of reach" in done.output
    assert "Traceback" not in done.output
    assert here == []


def test_the_projectors_pollers_look_on_one_connection_each_and_on_a_new_one_once_it_is_lost(
    settings: Settings,
) -> None:
    """The rebuilds' and the dead letters' pollers look for requests every second or less: a
    connection for each look cost Postgres a backend's start and an authentication every time.
    Each keeps one, and opens another once Postgres has ended it."""
    from spark.rebuilder import Rebuilder
    from spark.retrier import Retrier

    chosen = [PROJECTIONS["customers"]]
    pollers = [
        Rebuilder(cast(Any, None), settings, chosen, [], cast(Any, None)),
        Retrier(cast(Any, None), settings, [], keep=lambda p: None),  # its looks need no Spark
    ]
    with psycopg.connect(settings.database(), autocommit=True) as conn:

        def backends() -> set[int]:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
            return {int(r[0]) for r in rows}

        before = backends()
        for _ in range(5):
            assert [p.run_once() for p in pollers] == [False, 0]
        kept = backends() - before
        assert len(kept) == 2, kept  # one each, for five looks each
        for pid in kept:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        for p in pollers:  # the look on the lost connection fails (the thread says so) ...
            with pytest.raises(psycopg.OperationalError):
                p.run_once()
        assert [p.run_once() for p in pollers] == [False, 0]  # ... the next one works
        again = backends() - before
        assert len(again) == 2 and not again & kept, again
    for p in pollers:
        p.db.close()
