"""The projector runs unchanged under `spark-submit`, as docs/operations.md shows for a cluster
(here with a local master)."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from config.settings import Settings
from events.customer import CustomerRegistered
from spark.session import kafka_jars
from stack.procs import wait_until
from tests.support import REPO, append_events, child_env, new_deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_spark_submit_runs_the_projector(base_settings: Settings, tmp_path: Path) -> None:
    settings = new_deployment(base_settings)
    customer = str(uuid.uuid4())
    append_events(
        settings,
        "customer",
        customer,
        (1, CustomerRegistered("Sub", "sub@example.com"), "2026-11-21T10:00:00Z"),
    )

    submit = Path(sys.executable).parent / "spark-submit"
    log = (tmp_path / "spark-submit.log").open("wb")
    proc = subprocess.Popen(
        [
            str(submit),
            "--master",
            "local[1]",
            "--jars",
            ",".join(kafka_jars(settings)),
            str(REPO / "spark" / "projector.py"),
        ],
        cwd=REPO,
        env={**child_env(settings), "PYSPARK_PYTHON": sys.executable},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def projected() -> bool:
            with psycopg.connect(settings.database()) as conn:
                row = conn.execute("SELECT name FROM customers WHERE customer_id = %s", (customer,))
                return row.fetchone() == ("Sub",)

        wait_until(projected, 240, "spark-submit's projector to fold the event")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
