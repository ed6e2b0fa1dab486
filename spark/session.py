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
CODEGEN_FROM_RECORDS = 10_000  # a live batch this large is planned with generated code


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
        .config("spark.ui.showConsoleProgress", "false")  # Logfold's commands draw their own
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


def codegen(spark: SparkSession, on: bool) -> None:
    """Whether the session's next plans compile Java code (Spark's default) or interpret their
    expressions."""
    spark.conf.set("spark.sql.codegen.wholeStage", str(on).lower())
    spark.conf.set("spark.sql.codegen.factoryMode", "FALLBACK" if on else "NO_CODEGEN")


class BatchCodegen:
    """Code generation for a live query's micro-batches, by their size.

    Spark generates and compiles Java code for every batch's plan. On a batch of a few records,
    as at tens of commands/s, writing that code costs more than interpreting the expressions
    does (`bench/read_side.py batch`: 143 -> 109 ms a batch, and under load the command -> view
    p50 at 50/s fell from 808 to 420 ms); on a whole log it pays (5.3 s against 6.2 s). So a
    live query interprets while its batches are small, and generates code once one is large:
    the batches after a large one (catching up) are likely large too.
    """

    def __init__(self, from_records: int = CODEGEN_FROM_RECORDS) -> None:
        self.from_records = from_records
        self.on: bool | None = None

    def fit(self, spark: SparkSession, last_batch: int) -> None:
        """Set `spark` (the batch's session, which also plans the query's next batches) by
        the size of the last batch."""
        on = last_batch >= self.from_records
        if on != self.on:
            codegen(spark, on)
            self.on = on
