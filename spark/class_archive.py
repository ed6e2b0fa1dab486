"""A class-data-sharing archive of the Spark driver's JVM: every Logfold process that starts
Spark (the projector, a rebuild, the tests) maps the classes Spark loads from one file, already
parsed and verified, instead of loading each from its jar: a session and its first query in
0.59x the time (`bench/read_side.py spark-start`).

`make bootstrap` makes it (stack/class_archive.py). A JVM or pyspark other than the one it was
made for (the file's name says which) finds no archive, and starts as it would without one; a
JVM that finds an archive it cannot use (another class path, say) ignores it."""

from __future__ import annotations

import hashlib
from pathlib import Path

from config.jvm import java
from config.settings import Settings

# The JVM's messages about the archive (a class it cannot archive, a class path that differs
# from the archive's) are not the user's business: the archive is an optimisation.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def archive_path(settings: Settings) -> Path:
    """Where the archive for this machine's JVM and pyspark is (it may not exist)."""
    import pyspark

    key = hashlib.sha256(f"{pyspark.__version__} {java()}".encode()).hexdigest()[:12]
    return settings.lib_path / "spark-cds" / f"spark-{pyspark.__version__}-{key}.jsa"


def java_options(settings: Settings) -> str:
    """The driver JVM's options that use the archive, if there is one (and it is not off)."""
    path = archive_path(settings)
    if not settings.spark_class_archive:
        return ""
    return f"-XX:SharedArchiveFile={path.resolve()} {QUIET}" if path.is_file() else ""
