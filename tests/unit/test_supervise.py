"""`logfold run` starts again what it started and what exited: its own services (a Kafka node,
a Spark worker, the balancer) as well as its children, and stops when one keeps exiting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from config.settings import Settings
from stack.local import RESTARTS, LocalStack, Node


class Service:
    """A process as the stack's services hold one: `.proc`, which a restart replaces."""

    def __init__(self, code: int) -> None:
        self.code, self.starts = code, 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({self.code})"])
        self.proc.wait()


def test_a_service_that_exits_is_started_again_and_one_that_keeps_exiting_stops_the_stack() -> None:
    said: list[str] = []
    stack = LocalStack(Settings(), say=said.append)
    broker, worker = Service(-9), Service(1)
    broker.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stack.nodes += [
        Node("Kafka node 2", lambda: broker.proc, broker.start),
        Node("Spark worker 1", lambda: worker.proc, worker.start),
    ]
    try:
        for _ in range(RESTARTS):
            stack.supervise()
        assert (broker.starts, worker.starts) == (1, 1 + RESTARTS)  # the live one left alone
        assert said[0] == "Spark worker 1 exited with 1; starting it again"
        with pytest.raises(RuntimeError, match="Spark worker 1 exited with 1 6 times in 300 s"):
            stack.supervise()
        broker.proc.kill()
        broker.proc.wait()
        stack.nodes.pop()
        stack.supervise()
        assert broker.starts == 2 and said[-1] == "Kafka node 2 exited with -9; starting it again"
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            broker.proc.kill()
