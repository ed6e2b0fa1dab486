"""The Spark driver starts from the class archive `make bootstrap` made (spark/class_archive.py):
its JVM maps the archive's file, so the classes Spark loads come from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.settings import Settings
from spark import class_archive
from spark.session import session

pytestmark = pytest.mark.integration


def test_a_spark_session_maps_the_class_archive_bootstrap_made(base_settings: Settings) -> None:
    archive = class_archive.archive_path(base_settings)
    assert archive.is_file(), "`make bootstrap` makes it (python -m stack.class_archive)"
    spark = session(base_settings, "logfold-class-archive-test")
    gateway = spark.sparkContext._gateway
    assert gateway is not None
    maps = Path(f"/proc/{gateway.proc.pid}/maps").read_text()
    assert str(archive.resolve()) in maps, "the driver's JVM does not map the class archive"
