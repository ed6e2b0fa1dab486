"""A Spark standalone master and two workers from pyspark's own distribution
(`stack.local_spark.SparkStandalone`, as the cluster topology starts them): an application
runs on their executors, and when a worker is killed with `kill -9` the master sees it gone and
the application's next job runs on the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from stack.local_spark import SparkStandalone
from stack.procs import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(workdir: Path) -> Iterator[SparkStandalone]:
    spark = SparkStandalone(workdir / "spark-standalone", workers=2, cores=2, memory="512m")
    spark.start()
    yield spark
    spark.stop()


def test_jobs_run_on_the_workers_and_go_on_when_one_is_killed(cluster: SparkStandalone) -> None:
    assert [w["cores"] for w in cluster.alive_workers()] == [2, 2]
    spark = (
        SparkSession.builder.master(cluster.url)
        .appName("standalone-check")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.memory", "512m")
        .config("spark.cores.max", "4")
        .getOrCreate()
    )
    try:
        assert spark.range(1000).selectExpr("sum(id)").first()[0] == 499_500
        apps = cluster.state()["activeapps"]
        assert [a["name"] for a in apps] == ["standalone-check"] and apps[0]["cores"] == 4

        cluster.kill_worker(0)
        wait_until(lambda: len(cluster.alive_workers()) == 1, 60, "the master to see it gone")
        assert spark.range(1000).selectExpr("sum(id)").first()[0] == 499_500
    finally:
        spark.stop()
