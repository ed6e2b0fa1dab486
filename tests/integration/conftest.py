"""Each test module gets its own deployment (topic prefix) on the session's broker, so tests
never see each other's data."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from app import close_app, create_app
from cdc.capture import Capture
from commands.processor import CommandProcessor
from config.settings import Settings
from stack.local_kafka import LocalKafka
from stack.procs import free_port
from tests.support import REPO, Processes, drop_cdc_slot, new_deployment, projector_session


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    return new_deployment(base_settings)


@pytest.fixture(scope="module")
def spark(deployment: Settings) -> Iterator[Any]:
    """A Spark session in this process, as the projector makes one. The JVM outlives it: the
    next module's session starts in the same, already warmed JVM (a rebuild run here costs
    a fraction of `logfold rebuild`'s new one)."""
    s = projector_session(deployment, "logfold-tests")
    yield s
    s.stop()


@pytest.fixture
def fresh(base_settings: Settings) -> Iterator[Settings]:
    """A deployment of the test's own, whose CDC slot is dropped after it."""
    settings = new_deployment(base_settings)
    yield settings
    drop_cdc_slot(settings)


@pytest.fixture(scope="module")
def projecting(
    deployment: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Processes]:
    """A projector process (the real CLI) folding the module's deployment; the last of
    `.procs` is the projector running now (a test may kill it and start another)."""
    running = Processes(deployment, tmp_path_factory.mktemp("projector-logs"))
    running.projector()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def processor(deployment: Settings) -> Iterator[CommandProcessor]:
    proc = CommandProcessor(deployment)
    thread = threading.Thread(target=proc.run, name="processor", daemon=True)
    thread.start()
    yield proc
    proc.stop()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def capture(deployment: Settings) -> Iterator[Capture]:
    """CDC for the module's deployment, in a thread."""
    cdc = Capture(deployment)
    thread = threading.Thread(target=cdc.run, name="cdc", daemon=True)
    thread.start()
    yield cdc
    cdc.stop()
    thread.join(timeout=30)
    drop_cdc_slot(deployment)


@pytest.fixture
def own_broker(workdir: Path) -> Iterator[LocalKafka]:
    """A Kafka broker of the test's own, for tests that stop or kill it."""
    data = Path(tempfile.mkdtemp(prefix="kafka-", dir=workdir))
    broker = LocalKafka(REPO / ".stack" / "lib", data, free_port(), free_port())
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def client(
    deployment: Settings, processor: CommandProcessor, capture: Capture
) -> Iterator[FlaskClient]:
    app = create_app(deployment)
    yield app.test_client()
    close_app(app)
