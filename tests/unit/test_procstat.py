"""The benchmarks' CPU meter (bench/procstat.py) counts a process that ends inside the window,
whether its parent waits for it or not, and counts it once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.procstat import TreeCpu

# A parent that forks a child; the child waits for SIGUSR1, burns 0.3 s of CPU and exits.
# `waits`: the parent reaps it with waitpid (its CPU moves to the parent's children time);
# otherwise the parent ignores SIGCHLD and the kernel reaps it (Spark's Python daemon does).
PARENT = """
import os, signal, sys, time
waits = sys.argv[1] == "waits"
if not waits:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
pid = os.fork()
if pid == 0:
    signal.sigwait({signal.SIGUSR1})
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    os._exit(0)
print(pid, flush=True)
if waits:
    os.waitpid(pid, 0)
sys.stdin.read()
"""


@pytest.mark.parametrize("parent", ["waits", "ignores"])
def test_a_child_that_ends_in_the_window_counts_once(parent: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, parent],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        meter = TreeCpu(proc.pid)
        meter.sample()
        assert child in meter.first, "the child is sampled before it starts working"
        os.kill(child, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while child in meter.last:
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.02)
            meter.sample()
        user, system = meter.seconds()
        # Its last sample may miss up to one interval of its work; never twice it.
        assert 0.2 <= user + system <= 0.45
    finally:
        proc.kill()
        proc.wait()
