"""Making the Spark driver's class archive (spark/class_archive.py), once: `make bootstrap`
runs it, or `python -m stack.class_archive`.

A JVM that runs a little of what Logfold's jobs do writes the classes it loaded when it exits.
Only once that JVM has exited cleanly is the file put in place, atomically: a JVM given a
truncated archive does not start."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from config.settings import Settings
from spark.class_archive import QUIET, archive_path
from spark.session import session


def ensure(settings: Settings) -> Path:
    """Make the archive unless it exists: about half a minute, once."""
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


def _write(archive: Path) -> None:
    """Start a session whose JVM writes `archive` when it exits, run a little of each kind of
    work Logfold's jobs do (JSON decoding, aggregation, windows, Arrow to pandas, a streaming
    query), then stop the JVM and wait until it has exited, its archive complete."""
    from pyspark.sql import functions as F

    option = f"-XX:ArchiveClassesAtExit={archive} {QUIET}"
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


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stack.class_archive",
        description="Make the Spark driver's class archive unless it exists (once: each "
        "Spark process then starts sooner) and print where it is.",
    )
    parser.add_argument("--write", type=Path, metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        _write(args.write)
    else:
        print(ensure(Settings()))


if __name__ == "__main__":
    main()
