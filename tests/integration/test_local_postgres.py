"""The local Postgres asks for a password (scram-sha-256 on 127.0.0.1): knowing the port is not
enough. A data directory made before passwords (trust) gets one when the stack starts it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import psycopg
import pytest

from app import close_app, create_app
from config.settings import Settings
from projections.registry import VIEWS
from stack.local_postgres import LocalPostgres
from stack.procs import free_port
from tests.support import new_deployment, token

pytestmark = pytest.mark.integration


def without_password(server: LocalPostgres) -> str:
    return f"postgresql://logfold@127.0.0.1:{server.port}/postgres"


def refuses_without_password(server: LocalPostgres) -> bool:
    try:
        with psycopg.connect(without_password(server), connect_timeout=5):
            return False
    except psycopg.OperationalError as e:
        return "password" in str(e)


def test_the_local_server_needs_the_password(postgres: LocalPostgres) -> None:
    assert refuses_without_password(postgres)
    wrong = postgres.url.replace(postgres.password(), "guess")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=5)
    with psycopg.connect(postgres.url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert postgres.password_file.stat().st_mode & 0o777 == 0o600


def test_the_local_database_compares_text_by_its_bytes(
    postgres: LocalPostgres, base_settings: Settings
) -> None:
    """Collation C (sorts and index builds of ids without the C library's collation), with
    characters still classified as UTF-8; a deployment's own database too."""
    for url in (postgres.url, new_deployment(base_settings).database()):
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT datcollate, datctype, upper('é') FROM pg_database "
                "WHERE datname = current_database()"
            ).fetchone()
            assert row == ("C", "C.UTF-8", "É"), (url, row)


def test_a_data_directory_made_with_trust_gets_a_password(workdir: Path) -> None:
    server = LocalPostgres(Path(tempfile.mkdtemp(prefix="pg-trust-", dir=workdir)), free_port())
    server.start()
    server.stop()
    hba = server.data_dir / "pgdata" / "pg_hba.conf"
    hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))  # as older versions made
    server.start()
    try:
        rules = [
            ln.split() for ln in hba.read_text().splitlines() if ln.strip()[:1] not in ("", "#")
        ]
        assert rules and all(rule[-1] == "scram-sha-256" for rule in rules), rules
        assert refuses_without_password(server)
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()


def test_the_api_role_reads_the_views_and_writes_nothing(
    postgres: LocalPostgres, base_settings: Settings
) -> None:
    deployment = new_deployment(base_settings)  # migrated: its tables are readable by the role
    api_url = postgres.api_url().rsplit("/", 1)[0] + "/" + deployment.database().rsplit("/", 1)[1]
    assert postgres.password() not in api_url  # a login of its own
    with psycopg.connect(api_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM customers").fetchone() == (0,)
        for statement in (
            "INSERT INTO customers (customer_id, name, email, version) VALUES ('x', 'x', 'x', 1)",
            "UPDATE projection_progress SET late_events = 0",
            "DELETE FROM orders",
            "CREATE TABLE mine (x int)",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)

    app = create_app(deployment.model_copy(update={"api_database_url": api_url}))
    try:
        client = app.test_client()
        auth = {"Authorization": f"Bearer {token()}"}
        assert client.get("/views/customers", headers=auth).status_code == 200
        assert client.get("/views", headers=auth).status_code == 200
        components = client.get("/health", headers=auth).json["components"]
        assert components["postgres"]["status"] == "up"
        assert "permission" not in str(components["cdc"]), components["cdc"]
        rows, snapshot = app.extensions["logfold.read_model"].snapshot(
            VIEWS["customers"][1], {}, 10
        )
        assert rows == [] and snapshot.xmin <= snapshot.xmax  # no lock needed, none taken
    finally:
        close_app(app)


def test_a_server_started_from_a_private_folder_says_nothing(
    workdir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout in a private (0700) folder: the server's user cannot enter the caller's
    directory, and initdb used to say so on the terminal, among `logfold run`'s prefixed lines."""
    private = Path(tempfile.mkdtemp(prefix="checkout-"))  # 0700
    monkeypatch.chdir(private)
    server = LocalPostgres(Path(tempfile.mkdtemp(prefix="pg-private-", dir=workdir)), free_port())
    server.start()
    try:
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
        private.rmdir()
    said = capfd.readouterr()
    assert "could not change directory" not in said.out + said.err, said
