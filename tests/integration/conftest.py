"""One real Kafka broker and one real Postgres per test session, on free ports, in a temporary
directory. Each test module gets its own deployment (topic prefix) so tests never see each
other's data."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from app import create_app
from commands.processor import CommandProcessor
from stack.local_kafka import LocalKafka
from stack.local_postgres import LocalPostgres
from stack.migrate import upgrade
from stack.procs import free_port
from stack.settings import Settings
from tests.support import REPO, SECRET, new_deployment


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="logfold-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka(workdir: Path) -> Iterator[LocalKafka]:
    broker = LocalKafka(REPO / ".stack" / "lib", workdir / "kafka", free_port(), free_port())
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def postgres(workdir: Path) -> Iterator[LocalPostgres]:
    server = LocalPostgres(workdir / "pg", free_port())
    server.start()
    upgrade(server.url)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_settings(kafka: LocalKafka, postgres: LocalPostgres) -> Settings:
    return Settings(
        kafka_bootstrap_servers=kafka.bootstrap,
        database_url=postgres.url,
        jwt_secret=SECRET,
        partitions=4,
        command_timeout_s=10,
    )


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    return new_deployment(base_settings)


@pytest.fixture(scope="module")
def processor(deployment: Settings) -> Iterator[CommandProcessor]:
    proc = CommandProcessor(deployment)
    thread = threading.Thread(target=proc.run, name="processor", daemon=True)
    thread.start()
    yield proc
    proc.stop()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(deployment: Settings, processor: CommandProcessor) -> Iterator[FlaskClient]:
    app = create_app(deployment)
    yield app.test_client()
    app.extensions["logfold.bus"].close()
