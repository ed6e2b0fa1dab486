"""The JVMs Logfold starts map the class archives `make bootstrap` made (stack/class_archive.py):
Spark's driver (spark/class_archive.py) and Kafka's broker (stack/local_kafka.py). Each JVM maps
its archive's file, so the classes it loads come from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.settings import Settings
from spark import class_archive
from spark.session import session
from stack import local_kafka
from stack.local_kafka import LocalKafka
from tests.support import REPO

pytestmark = pytest.mark.integration


def maps(pid: int, archive: Path) -> bool:
    return str(archive.resolve()) in Path(f"/proc/{pid}/maps").read_text()


def test_a_spark_session_maps_the_class_archive_bootstrap_made(base_settings: Settings) -> None:
    archive = class_archive.archive_path(base_settings)
    assert archive.is_file(), "`make bootstrap` makes it (python -m stack.class_archive)"
    spark = session(base_settings, "logfold-class-archive-test")
    try:
        gateway = spark.sparkContext._gateway
        assert gateway is not None
        assert maps(gateway.proc.pid, archive), "the driver's JVM does not map the class archive"
    finally:
        # Not left active: a later module's session (the same JVM's) would get this one's
        # settings, and its projector too few slots.
        spark.stop()


def test_a_kafka_broker_maps_the_class_archive_bootstrap_made(kafka: LocalKafka) -> None:
    archive = local_kafka.archive_path(REPO / ".stack" / "lib")
    assert archive.is_file(), "`make bootstrap` makes it (python -m stack.class_archive)"
    assert kafka.proc is not None
    assert maps(kafka.proc.pid, archive), "the broker's JVM does not map the class archive"
