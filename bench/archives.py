"""What the start benchmarks report: starts with a class archive against without (Spark's
driver, `read_side.py spark-start`; Kafka's broker, `commands.py broker-start`)."""

from __future__ import annotations

import statistics
from pathlib import Path


def with_and_without(
    benchmark: str, archive: Path, runs: dict[str, list[dict[str, float]]]
) -> dict[str, object]:
    """`runs`: each start's figures, under "with" and "without"; their medians and ratios."""
    medians = {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()
    }
    return {
        "benchmark": benchmark,
        "archive_mib": archive.stat().st_size / 2**20,
        "medians": medians,
        "with/without": {k: medians["with"][k] / medians["without"][k] for k in medians["with"]},
        "runs": runs,
    }
