"""One real Kafka broker and one real Postgres per test session, on free ports, in a temporary
directory; started only when a test asks for them (unit tests never do)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.settings import C1_ALONE, Settings
from stack.local_kafka import LocalKafka
from stack.local_postgres import LocalPostgres
from stack.migrate import upgrade
from stack.procs import free_port
from tests.support import REPO, SECRET, SUITE_ENV

# A test's projector lives seconds to a minute: its JVM is ready sooner with the quick JIT
# compiler alone (test_projector.py: 175 s against 202 s with both). The stacks `logfold run`
# starts in the e2e tests keep the default (both compilers), as the benchmarks do.
SUITE_ENV["LOGFOLD_PROJECTOR_JAVA_OPTIONS"] = C1_ALONE
# Nor does a test's projector rehearse a rebuild once started (a test's log is too small for
# it to pay; the README flow's first stack keeps it): an in-process one's rehearsal would go
# on in the suite's Spark session after its test (test_event_pipeline.py tests the rehearsal
# itself).
SUITE_ENV["LOGFOLD_PROJECTOR_REBUILD_REHEARSAL_RECORDS"] = "0"


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
    # Its data goes with the work directory: a controlled shutdown would only cost the suite
    # seconds (the stack's own stops are tested through `logfold run`).
    broker.kill()


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
        # No test reads a view's first seconds for speed: projectors start without warming up
        # (the stacks `logfold run` starts, and one test of a broken fold, keep the default).
        projector_warm_up_rounds=0,
        projector_rebuild_rehearsal_records=0,
    )
