"""The projector on a Spark standalone cluster (`stack.local_spark.SparkStandalone`, as `logfold
run --cluster` starts it) whose one worker has fewer task slots than real-time mode needs: the
projector folds in micro-batches on its own and `/health` says so and why; the views stay
exactly the log's fold. When the worker is killed (`kill -9`), `/health` reports the projector
down for want of executors within seconds, though no view lags yet; a command posted meanwhile
is accepted, and reaches its view once the worker is back; it comes back with the slots, and
the queries go back to real-time mode on their own, losing and doubling nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from config.settings import Settings
from stack.local_spark import SparkStandalone
from stack.procs import wait_until
from tests.support import HttpApi, Processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CORES = 4  # fewer than the real-time queries' slots (22 with the default partitions)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SparkStandalone]:
    spark = SparkStandalone(tmp_path / "spark", workers=1, cores=CORES, memory="2g")
    spark.start()
    yield spark
    spark.stop()


def _projector(api: HttpApi) -> dict[str, Any]:
    component: dict[str, Any] = api.get("/health").json()["components"].get("projector", {})
    return component


def _in_view(api: HttpApi, customer: str, position: str, wait: int = 5) -> bool:
    answer = api.get(
        f"/views/customers/{customer}?consistent_with={position}&wait={wait}", headers=_auth(api)
    )
    return answer.status_code == 200


def _auth(api: HttpApi) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.bearer}"}


def test_a_projector_on_too_few_slots_folds_in_micro_batches_and_health_sees_its_executors(
    fresh: Settings, cluster: SparkStandalone, tmp_path: Path
) -> None:
    import sys

    # No warm-up (the suite's setting): the slots are counted right after the session
    # started, once it has waited for the executor (before it registered: "Spark has 0").
    env = {"LOGFOLD_SPARK_MASTER": cluster.url, "PYSPARK_PYTHON": sys.executable}
    procs = Processes(fresh, tmp_path, env)
    try:
        procs.processor()
        procs.projector()
        _, url = procs.api()
        api = HttpApi(url)
        wait_until(lambda: _projector(api).get("status") == "up", 180, "the projector up")
        status = _projector(api)
        assert status["executors"] == 1 and status["slots"] == CORES, status
        assert status["slots_needed"] > CORES
        for name, query in status["queries"].items():
            assert query["mode"] == "micro-batch", (name, query)
            assert f"Spark has {CORES}" in query["why"], query

        first = api.command("register-customer", {"name": "Ada", "email": "ada@example.com"})
        assert first.status == 201, first.body
        ada = first.body["aggregate_id"]
        wait_until(lambda: _in_view(api, ada, first.body["position"]), 120, "Ada in the view")

        cluster.kill_worker(0)
        lost = time.monotonic()
        wait_until(lambda: _projector(api).get("status") == "down", 60, "the projector down")
        # (how soon, for the record: the beat, then the health checks' rounds)
        print(f"projector reported down {time.monotonic() - lost:.1f} s after the worker died")
        assert _projector(api)["executors"] == 0
        lag = api.get("/health").json()["components"]
        assert all(c["status"] == "up" for n, c in lag.items() if n.startswith("projection:"))

        second = api.command(
            "register-customer",
            {"name": f"Bo {uuid.uuid4().hex[:6]}"} | {"email": "bo@example.com"},
        )
        assert second.status == 201, second.body
        assert not _in_view(api, second.body["aggregate_id"], second.body["position"], wait=1)

        # The worker comes back with the slots real-time mode needs.
        cluster.start_worker(0, cores=status["slots_needed"])
        wait_until(lambda: _projector(api).get("status") == "up", 120, "the projector back up")
        bo = second.body["aggregate_id"]
        wait_until(lambda: _in_view(api, bo, second.body["position"]), 120, "Bo in the view")

        def modes() -> set[str]:
            return {q["mode"] for q in _projector(api)["queries"].values()}

        wait_until(lambda: modes() == {"real-time"}, 120, "every query back in real-time mode")
        third = api.command("register-customer", {"name": "Cy", "email": "cy@example.com"})
        assert third.status == 201, third.body
        cy = third.body["aggregate_id"]
        wait_until(lambda: _in_view(api, cy, third.body["position"]), 60, "Cy in the view")
        rows = api.get("/views/customers", headers=_auth(api)).json()["rows"]
        assert sorted(r["customer_id"] for r in rows) == sorted([ada, bo, cy])
        assert all(r["version"] == 1 for r in rows)
    finally:
        procs.stop()
