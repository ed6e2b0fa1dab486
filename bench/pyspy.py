"""Sampling profiles of running processes with py-spy, folded into named stages.

py-spy samples only threads that are running (not waiting), so a stage's samples divided by
the sampling rate are the CPU seconds spent in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

Rules = list[tuple[str, str]]  # (substring of a folded stack, stage); the first match wins


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: pip install -e '.[dev]' (it is a dev dependency)")
    return found


class Recording:
    """`py-spy record` of one process (and its children: gunicorn's workers) until `stop()`."""

    def __init__(self, pid: int, out: Path, rate: int = 200) -> None:
        self.out, self.rate = out, rate
        self.proc = subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--subprocesses",
                "--nonblocking",  # never pause the profiled process
                # Only the thread holding the GIL: without pausing, py-spy takes threads
                # waiting in epoll or on a condition for running ones.
                "--gil",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> Counter[str]:
        """Stop sampling and return samples per folded stack."""
        self.proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        self.proc.wait(timeout=60)
        stacks: Counter[str] = Counter()
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                stacks[stack] += int(count)
        return stacks


def stages(stacks: Counter[str], rules: Rules, default: str) -> Counter[str]:
    """Samples per stage: each stack goes to the first rule whose text it contains."""
    found: Counter[str] = Counter()
    for stack, count in stacks.items():
        found[next((stage for text, stage in rules if text in stack), default)] += count
    return found


def top(stacks: Counter[str], n: int = 15) -> list[tuple[str, int]]:
    """The leaf functions that took the most samples (where to look next)."""
    leaves: Counter[str] = Counter()
    for stack, count in stacks.items():
        leaves[stack.rsplit(";", 1)[-1]] += count
    return leaves.most_common(n)
