"""The API, CDC and migration processes, and the CLI's listings, never load Spark (issue 8,
point 5).

Each check runs in a fresh interpreter: this test process may already hold pyspark from other
tests, and an import that happened elsewhere would hide the one we look for.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# What each process imports at start-up; migrations/env.py's own imports, without running it
# (it needs Alembic's context, which exists only inside `alembic upgrade`).
PROCESSES = {
    "api": "import stack.cli, stack.local, stack.serve, app",
    "cdc": "import cdc.capture",
    "migrations": (
        "import cdc.state, projections.base.progress, projections.registry, stack.migrate"
    ),
    "read model": "from projections.registry import FOLDS; [f.views for f in FOLDS.values()]",
    # `logfold projections`: a listing, from Postgres alone.
    "projections listing": (
        "import app.read_model, projections.base.versions, projections.registry, spark.keeping"
    ),
    # `logfold rebuild` handed to the running projector: asks and follows, from Postgres alone.
    "rebuild asked of the projector": "import projections.base.rebuilds, stack.cli, tqdm",
}


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_process_does_not_import_pyspark(name: str) -> None:
    script = textwrap.dedent(f"""
        import sys
        {PROCESSES[name]}
        loaded = sorted(m for m in sys.modules if m == "pyspark" or m.startswith("pyspark."))
        print(",".join(loaded))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{name} loaded {done.stdout.strip()}"


def test_the_check_sees_pyspark_when_it_is_imported() -> None:
    """The probe itself works: a process that does import pyspark is caught."""
    script = "import sys, pyspark; print('pyspark' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "True", done.stderr


# What the API process must not load: Spark, the migration tooling and its scripts, the CDC
# process's replication driver, and the roof (the CLI and local services).
NOT_FOR_THE_API = ("pyspark", "alembic", "psycopg2", "migrations", "stack")


def test_the_api_loads_none_of_what_it_does_not_run() -> None:
    """The Flask application and every module it imports (app/*, built as a process does)."""
    script = textwrap.dedent(f"""
        import pkgutil, sys
        import app
        for info in pkgutil.iter_modules(app.__path__):
            __import__(f"app.{{info.name}}")
        app.create_app
        banned = {NOT_FOR_THE_API!r}
        loaded = sorted(
            m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned)
        )
        print(",".join(loaded))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"the API loaded {done.stdout.strip()}"
