"""Making the class archives of the JVMs Logfold starts, once: the Spark driver's
(spark/class_archive.py) and the Kafka broker's (stack/local_kafka.py). `make bootstrap` runs
it, or `python -m stack.class_archive`.

A JVM that runs a little of what Logfold does writes the classes it loaded when it exits. Only
once that JVM has exited cleanly is the file put in place, atomically: a JVM given a truncated
archive does not start."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from config.settings import Settings, kafka_client_options, kafka_consumer_options
from spark.class_archive import QUIET, archive_path
from spark.session import session
from stack import local_kafka
from stack.procs import free_port


def ensure(settings: Settings) -> Path:
    """Make Spark's archive unless it exists: about half a minute, once."""
    path = archive_path(settings)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    made = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    made.unlink(missing_ok=True)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "stack.class_archive", "--write", str(made)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        if out.returncode != 0 or not made.is_file():
            raise RuntimeError(f"no class archive was written: {out.stderr[-2000:]}")
        made.replace(path)
    finally:
        made.unlink(missing_ok=True)
    return path


def _write(archive: Path, option: str = "") -> None:
    """Start a session whose JVM writes `archive` when it exits, run a little of each kind of
    work Logfold's jobs do (JSON decoding, aggregation, windows, Arrow to pandas, a streaming
    query), then stop the JVM and wait until it has exited, its archive complete. `option`
    writes another kind of archive than JDK 17's dynamic one (a JDK 25 ahead-of-time cache)."""
    from pyspark.sql import functions as F

    option = option or f"-XX:ArchiveClassesAtExit={archive} {QUIET}"
    spark = session(Settings(), "logfold-class-archive", java_options=option)
    rows = spark.range(2000).selectExpr(
        "id",
        "to_json(named_struct('k', cast(id % 7 as string), 'v', id)) AS value",
        "timestamp_seconds(id) AS at",
    )
    decoded = rows.select("id", "at", F.from_json("value", "k STRING, v LONG").alias("e"))
    decoded.groupBy("e.k").agg(F.sum("e.v"), F.max("at")).toPandas()
    decoded.groupBy(F.window("at", "1 minute")).count().collect()
    query = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 100)
        .load()
        .writeStream.format("memory")
        .queryName("logfold_class_archive")
        .start()
    )
    deadline = time.monotonic() + 60
    while query.lastProgress is None and time.monotonic() < deadline:
        query.awaitTermination(1)
    query.stop()
    gateway = spark.sparkContext._gateway
    assert gateway is not None
    spark.stop()
    jvm = gateway.proc  # the JVM exits when its standard input closes
    jvm.stdin.close()
    if jvm.wait(timeout=240) != 0:
        raise SystemExit(f"the JVM exited with status {jvm.returncode}")


def ensure_kafka(lib_dir: Path) -> Path:
    """Make the Kafka broker's archive unless it exists: a broker started and stopped, with a
    little of what Logfold asks of it between (about 15 s, once)."""
    path = local_kafka.archive_path(lib_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    made = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    made.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="logfold-kafka-archive-") as data:
        broker = local_kafka.LocalKafka(
            lib_dir, Path(data), free_port(), free_port(), class_archive=False
        )
        broker.java_options = (f"-XX:ArchiveClassesAtExit={made}", *local_kafka.QUIET_ARCHIVE)
        try:
            broker.start()
            _kafka_work(broker.bootstrap)
            proc = broker.proc
            assert proc is not None
            broker.stop(timeout=60)  # SIGTERM: the JVM writes the archive as it exits
            # (143: it exited as SIGTERM asks; killed, or failed, its file may be truncated)
            if proc.returncode not in (0, 128 + signal.SIGTERM) or not made.is_file():
                raise RuntimeError(f"the broker exited with {proc.returncode}; see {data}")
            made.replace(path)
        finally:
            broker.kill()
            made.unlink(missing_ok=True)
    return path


def _kafka_work(bootstrap: str) -> None:
    """What the stack asks of a broker: a compacted topic, a transaction that commits a
    consumer's offsets with its records, a read of committed records in a group."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.structs import OffsetAndMetadata

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, **kafka_client_options())
    try:
        topics = [NewTopic(t, 2, 1, topic_configs={"cleanup.policy": "compact"}) for t in "ab"]
        admin.create_topics(topics)
        admin.describe_cluster()
    finally:
        admin.close()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        transactional_id="logfold-class-archive",
        acks="all",
        **kafka_client_options(),
    )
    consumer = KafkaConsumer(
        "a",
        bootstrap_servers=bootstrap,
        group_id="logfold-class-archive",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
        consumer_timeout_ms=10_000,
        **kafka_consumer_options(),
    )
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(100):
            producer.send("a", key=b"k%d" % (i % 10), value=b"v%d" % i)
        producer.commit_transaction()
        read = [next(consumer) for _ in range(100)]
        producer.begin_transaction()
        producer.send("b", key=b"k", value=b"v")
        offsets = {
            TopicPartition("a", p): OffsetAndMetadata(
                max(r.offset for r in read if r.partition == p) + 1, "", -1
            )
            for p in {r.partition for r in read}
        }
        producer.send_offsets_to_transaction(offsets, consumer.config["group_id"])
        producer.commit_transaction()
    finally:
        producer.close()
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stack.class_archive",
        description="Make the class archives of Spark's driver and Kafka's broker unless they "
        "exist (once: each Spark process and each broker then starts sooner) and print where "
        "they are.",
    )
    parser.add_argument("--write", type=Path, metavar="PATH", help=argparse.SUPPRESS)
    # JDK 25's ahead-of-time cache from the same work (bench/read_side.py rebuild-jvms)
    parser.add_argument("--write-aot-cache", type=Path, metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        _write(args.write)
    elif args.write_aot_cache:
        _write(args.write_aot_cache, f"-XX:AOTCacheOutput={args.write_aot_cache}")
    else:
        settings = Settings()
        print(ensure(settings))
        print(ensure_kafka(settings.lib_path))


if __name__ == "__main__":
    main()
