"""The SparkSession every Logfold job uses, with the Kafka connector on its classpath."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession

import stack
from stack import maven
from stack.settings import Settings

POM = Path(stack.__file__).parent / "spark" / "pom.xml"


def kafka_jars(settings: Settings) -> list[str]:
    target = maven.fetch(POM, settings.lib_path / "spark-kafka")
    return sorted(str(p) for p in target.glob("*.jar"))


def session(settings: Settings, app_name: str, java_options: str = "") -> SparkSession:
    """A session on `LOGFOLD_SPARK_MASTER`; under `spark-submit`, its --master and --jars win
    (and `java_options`, for the driver's JVM, apply only when this process starts it)."""
    # Python workers must run in this interpreter's environment (where pandas and Logfold are).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit, which set these
        builder = (
            builder.master(settings.spark_master)
            .config("spark.jars", ",".join(kafka_jars(settings)))
            .config("spark.driver.memory", settings.spark_driver_memory)
        )
        if java_options:
            builder = builder.config("spark.driver.extraJavaOptions", java_options)
    spark = (
        builder.config("spark.sql.shuffle.partitions", str(settings.spark_shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.scheduler.mode", "FAIR")
        # Local files without .crc checksum files: a streaming checkpoint writes two small
        # files per micro-batch, and checksumming them costs ~30 ms a batch. Logfold's
        # checkpoints are scratch (progress lives in Postgres) and it writes no other files.
        .config("spark.hadoop.fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem")
        .config(
            "spark.hadoop.fs.AbstractFileSystem.file.impl", "org.apache.hadoop.fs.local.RawLocalFs"
        )
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def idle_poll(spark: SparkSession, ms: int) -> None:
    """How long the next streaming query started waits, when it found no new records, before
    asking Kafka again (Spark reads it when the query starts; its default, 10 ms, keeps an idle
    query and the broker busy answering offset requests)."""
    spark.conf.set("spark.sql.streaming.pollingDelay", f"{ms}ms")
