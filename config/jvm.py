"""The Java runtime Logfold's JVMs run on: Kafka's brokers and Spark's driver."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def java() -> str:
    """`$JAVA_HOME/bin/java` if `JAVA_HOME` is set (as Spark's scripts choose), else the `java`
    on the `PATH`, with its links resolved: a class archive is made for one JVM."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return os.path.realpath(found) if found else "java"
