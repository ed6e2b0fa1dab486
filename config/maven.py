"""Fetching jars from Maven Central with a small pom kept in the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SETTINGS = Path(__file__).parent / "maven-settings.xml"


def fetch(pom: Path, target: Path) -> Path:
    """Copy the pom's runtime dependencies into `target`, unless already done for this pom."""
    target = target.resolve()
    stamp = target / ".pom"
    pom_text = pom.read_text()
    if stamp.exists() and stamp.read_text() == pom_text:
        return target
    if shutil.which("mvn") is None:
        raise RuntimeError("Maven (mvn) is needed to fetch jars: apt-get install maven")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-s",
            str(SETTINGS),
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={target}",
        ],
        check=True,
        stdout=sys.stderr,  # Maven's output (even quiet, it resets colours) is not the caller's
    )
    stamp.write_text(pom_text)
    return target
