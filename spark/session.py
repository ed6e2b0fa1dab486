"""The SparkSession every Logfold job uses, with the Kafka connector on its classpath."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession

from config import maven
from config.logs import is_debug, spark_level
from config.settings import Settings
from spark import class_archive

log = logging.getLogger(__name__)

POM = Path(__file__).parent / "pom.xml"
LOG4J = Path(__file__).parent / "log4j2.properties"
FULL_PLANNING_FROM_RECORDS = 10_000  # a live batch this large is planned as Spark does
# Classes of generated code a process keeps compiled (Spark's default: 100). A rebuild of
# every view generates ~120: with 100, each rebuild evicted the classes the next one needed
# first, so every rebuild compiled them all again, and the JVM then compiled them again to
# machine code: about a third of the JVM's CPU in a warm rebuild (`docs/benchmarks-journal.md`,
# rebuild).
CODEGEN_CACHE = 1000
# How long a session on a cluster's master waits for its first executor before it goes on without
# one: Spark's own bound for a job waiting for its resources
# (`spark.scheduler.maxRegisteredResourcesWaitingTime`).
EXECUTOR_WAIT_S = 30.0
# A cluster's executors register one by one, seconds apart under load: a session that needs more
# task slots than its first executor offers waits while more keep coming, until none has come
# for this long (or the slots are there, or EXECUTOR_WAIT_S has passed).
EXECUTORS_SETTLE_S = 5.0
CHECKPOINT_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)


def kafka_jars(settings: Settings) -> list[str]:
    target = maven.fetch(POM, settings.lib_path / "spark-kafka")
    return sorted(str(p) for p in target.glob("*.jar"))


def with_slots(master: str, slots: int) -> str:
    """`master`, given at least `slots` task threads if it is a local one (`local`,
    `local[n]`, `local[*]`, with task retries `local[n,f]`): a local thread is a slot, not a
    core, and a real-time query holds one per partition it reads for as long as it runs."""
    found = re.fullmatch(r"local(?:\[(\*|\d+)(,\d+)?\])?", master.strip())
    if found is None:
        return master
    threads = found[1] or "1"
    have = (os.cpu_count() or 1) if threads == "*" else int(threads)
    return f"local[{max(have, slots)}{found[2] or ''}]"


def session(
    settings: Settings, app_name: str, java_options: str = "", slots: int = 0
) -> SparkSession:
    """A session on `LOGFOLD_SPARK_MASTER` (a local one with at least `slots` task threads:
    `with_slots`); under `spark-submit`, its --master and --jars win (and `java_options`, for
    the driver's JVM, apply only when this process starts it)."""
    # Python workers must run in this interpreter's environment (where pandas and Logfold are).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    level = spark_level(settings.log_level)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit, which set these
        # Logging configured from the JVM's start: its first warnings come before any session.
        log4j = f"-Dlog4j2.configurationFile={LOG4J} -Dlogfold.spark.level={level}"
        # Classes mapped from the archive `make bootstrap` made, if any (spark/class_archive.py).
        java_options = f"{class_archive.java_options(settings)} {java_options}".strip()
        builder = (
            builder.master(with_slots(settings.spark_master, slots))
            .config("spark.jars", ",".join(kafka_jars(settings)))
            .config("spark.driver.memory", settings.spark_driver_memory)
            .config("spark.driver.extraJavaOptions", f"{java_options} {log4j}".strip())
        )
    spark = (
        builder.config("spark.sql.shuffle.partitions", str(settings.spark_shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # Logfold's commands draw their own
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.codegen.cache.maxEntries", str(CODEGEN_CACHE))
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.scheduler.mode", "FAIR")
        # Local files without .crc checksum files: a streaming checkpoint writes two small
        # files per micro-batch, and checksumming them costs ~30 ms a batch. Logfold's
        # checkpoints are scratch (progress lives in Postgres) and it writes no other files.
        .config("spark.hadoop.fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem")
        .config(
            "spark.hadoop.fs.AbstractFileSystem.file.impl", "org.apache.hadoop.fs.local.RawLocalFs"
        )
        # Those two files through Hadoop's FileSystem API, not its FileContext API (Spark's
        # default for checkpoints): writing a file and renaming it into place took ~20 ms
        # through FileContext and ~4 ms this way, twice in every micro-batch
        # (`docs/benchmarks-journal.md`, freshness). A local rename is atomic either way.
        .config("spark.sql.streaming.checkpointFileManagerClass", CHECKPOINT_FILE_MANAGER)
        # A decoded batch is cached once and read by every projection: cached uncompressed it
        # is built faster and read faster, for ~1.2x its memory (a rebuild's 1M events: 420
        # MB compressed, 497 MB not; `docs/benchmarks-journal.md`, rebuild).
        .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel(level)
    wait_for_executors(spark, EXECUTOR_WAIT_S, slots)
    return spark


def executors(spark: SparkSession) -> int:
    """Executors registered with the driver now (the driver itself not counted): on a local
    master, none; on a cluster, those its workers run for this application."""
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    return max(int(status.size()) - 1, 0)


def wait_for_executors(spark: SparkSession, timeout_s: float, slots: int = 0) -> bool:
    """On a cluster's master, wait up to `timeout_s` for the application's first executor, and
    while the executors registered offer fewer than `slots` task slots, for more (until none
    has come for EXECUTORS_SETTLE_S); say whether one came (a local master runs its tasks in
    the driver: at once). A session's first decisions (the projector's mode, by the task
    slots Spark offers) are then made on the cluster's executors, not before they have
    registered (a few seconds after the application, on a standalone cluster, one worker's
    after another's). Past the bound it goes on: its jobs wait for executors, and the
    projector's status reports none (or the slots it lacks)."""
    if (spark.sparkContext.master or "").startswith("local"):
        return True
    deadline = time.monotonic() + timeout_s
    seen, seen_at = 0, time.monotonic()
    while True:
        now, count = time.monotonic(), executors(spark)
        if count != seen:
            seen, seen_at = count, now
        if count > 0 and (
            int(spark.sparkContext.defaultParallelism) >= slots
            or now - seen_at >= EXECUTORS_SETTLE_S
        ):
            return True
        if now >= deadline:
            if count == 0:
                log.warning(
                    "no executor of %s registered within %.0f s: going on without one (are "
                    "its workers up, with the cores and memory it asks for?)",
                    spark.sparkContext.master,
                    timeout_s,
                )
            return count > 0
        time.sleep(0.1)


def quiet_stop(spark: SparkSession, settings: Settings) -> None:
    """Before stopping queries on request: stopping interrupts their running tasks, and Spark
    logs each interruption as an error with its Java stack. Expected, so shown only at debug."""
    if not is_debug(settings.log_level):
        spark.sparkContext.setLogLevel("OFF")


def idle_poll(spark: SparkSession, ms: int) -> None:
    """How long the next streaming query started waits, when it found no new records, before
    asking Kafka again (Spark reads it when the query starts; its default, 10 ms, keeps an idle
    query and the broker busy answering offset requests)."""
    spark.conf.set("spark.sql.streaming.pollingDelay", f"{ms}ms")


# Optimizer rules a small batch's plan does without: none is needed for a correct plan (Spark
# keeps those regardless), each only makes the plan faster to run, which on a few records is
# worth less than the rule's own time. Spark optimises every micro-batch's plan twice (to run
# it, and again to describe it), and for the event query's rows expressions these rules took
# half of that (`docs/benchmarks-journal.md`, freshness: queryPlanning 30 -> 15 ms a batch).
_OPTIMIZER = "org.apache.spark.sql.catalyst.optimizer"
LEAN_EXCLUDED_RULES = (
    *(
        f"{_OPTIMIZER}.{rule}"
        for rule in (
            "BooleanSimplification",
            "ConstantFolding",
            "FoldablePropagation",
            "MergeSubplans",
            "NullPropagation",
            "OptimizeCsvJsonExprs",
            "OptimizeIn",
            "OptimizeOneRowRelationSubquery",
            "PushFoldableIntoBranches",
            "RemoveRedundantAliases",
            "ReorderAssociativeOperator",
            "ReplaceNullWithFalseInPredicate",
            "SimplifyBinaryComparison",
            "SimplifyCasts",
            "SimplifyConditionals",
            "SimplifyExtractValueOps",
            "UnwrapCastInBinaryComparison",
        )
    ),
    "org.apache.spark.sql.execution.datasources.PruneFileSourcePartitions",
    "org.apache.spark.sql.execution.datasources.SchemaPruning",
)


def full_planning(spark: SparkSession, on: bool) -> None:
    """How the session plans from now on: as Spark does by default (`on`: every optimizer
    rule, generated Java code), or lean, for batches of a few records (interpreted
    expressions, and without the optimizer rules of `LEAN_EXCLUDED_RULES`)."""
    spark.conf.set("spark.sql.codegen.wholeStage", str(on).lower())
    spark.conf.set("spark.sql.codegen.factoryMode", "FALLBACK" if on else "NO_CODEGEN")
    if on:
        spark.conf.unset("spark.sql.optimizer.excludedRules")
    else:
        spark.conf.set("spark.sql.optimizer.excludedRules", ",".join(LEAN_EXCLUDED_RULES))


def batch_session(spark: SparkSession) -> SparkSession:
    """A session of `spark`'s context (its JVM, executors and cache) with SQL settings of its
    own, planning fully: for a whole-log batch (a rebuild, a changed version's build) run in the
    projector beside its live queries, which plan lean on the session they share."""
    own = spark.newSession()
    full_planning(own, True)
    return own


class BatchPlanning:
    """How a live query plans its micro-batches, by their size.

    Spark generates and compiles Java code for every batch's plan, and optimises it with every
    rule. On a batch of a few records, as at tens of commands/s, writing that code costs more
    than interpreting the expressions does (`bench/read_side.py batch`: 143 -> 109 ms a batch,
    and under load the command -> view p50 at 50/s fell from 808 to 420 ms), and most
    optimizer rules cost more than they save; on a whole log both pay (5.3 s against 6.2 s).
    So a live query plans lean while its batches are small, and fully once one is large: the
    batches after a large one (catching up) are likely large too.
    """

    def __init__(self, from_records: int = FULL_PLANNING_FROM_RECORDS) -> None:
        self.from_records = from_records
        self.on: bool | None = None

    def fit(self, spark: SparkSession, last_batch: int) -> None:
        """Set `spark` (the batch's session, which also plans the query's next batches) by
        the size of the last batch."""
        on = last_batch >= self.from_records
        if on != self.on:
            full_planning(spark, on)
            self.on = on
