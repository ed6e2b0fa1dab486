"""A Spark standalone cluster on this machine from pyspark's own distribution: a master and
workers started with its `spark-class`, each with its own ports and work directory."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from stack.procs import free_port, port_open, stop_process, wait_until


def spark_home() -> Path:
    """pyspark's own distribution (its `bin/spark-class` and jars). Found when needed: the
    processes that never run Spark (the API's among them) do not import pyspark."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise RuntimeError("pyspark is not installed: `make bootstrap`")
    return Path(spec.origin).parent


def _spark_class(main: str, *args: str) -> list[str]:
    return [str(spark_home() / "bin" / "spark-class"), main, *args]


class SparkStandalone:
    """A master and `workers` workers, each declaring `cores` task slots (a declared count,
    not checked against the hardware: real-time mode holds a slot per partition it reads)."""

    def __init__(self, data_dir: Path, workers: int = 2, cores: int = 12, memory: str = "1g"):
        self.data_dir, self.cores, self.memory = data_dir, cores, memory
        self.port, self.ui_port = free_port(), free_port()
        self.master_proc: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * workers

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / f"{name}.out").open("ab")
        env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1"}
        env["SPARK_LOG_DIR"] = str(self.data_dir / "logs")
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the master, without waiting: its workers start once it listens."""
        self.start_master()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the master listens; then start every worker and wait until each is alive."""
        wait_until(lambda: port_open(self.ui_port), timeout, f"the Spark master at {self.url}")
        for i in range(len(self.workers)):
            self.start_worker(i)
        wait_until(
            lambda: len(self.alive_workers()) == len(self.workers), timeout, "every Spark worker"
        )

    def start_master(self) -> None:
        """Start the master (again: on the same ports, where its workers find it) without
        waiting for it."""
        self.master_proc = self._spawn(
            "master",
            _spark_class(
                "org.apache.spark.deploy.master.Master",
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--webui-port", str(self.ui_port)),
            ),
        )

    def start_worker(self, i: int, cores: int | None = None) -> None:
        """Start worker `i` (again), declaring `cores` task slots (the cluster's own count if
        None), without waiting for it."""
        work = self.data_dir / f"worker-{i}"
        work.mkdir(parents=True, exist_ok=True)
        slots = str(cores or self.cores)
        self.workers[i] = self._spawn(
            f"worker-{i}",
            _spark_class(
                "org.apache.spark.deploy.worker.Worker",
                *("--host", "127.0.0.1", "--cores", slots, "--memory", self.memory),
                *("--webui-port", str(free_port()), "--work-dir", str(work), self.url),
            ),
        )

    def kill_worker(self, i: int) -> None:
        """`kill -9` worker `i` (its executors, children of it, go with it)."""
        proc = self.workers[i]
        if proc is not None:
            os.killpg(proc.pid, 9)
            proc.wait()
            self.workers[i] = None

    def state(self) -> dict[str, Any]:
        """The master's view of the cluster (its `/json/`): workers, cores, applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            found: dict[str, Any] = json.load(r)
        return found

    def alive_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.state().get("workers", []) if w.get("state") == "ALIVE"]

    def stop(self) -> None:
        for i in range(len(self.workers)):
            proc = self.workers[i]
            if proc is not None:
                stop_process(proc, timeout=20)
                self.workers[i] = None
        if self.master_proc is not None:
            stop_process(self.master_proc, timeout=20)
            self.master_proc = None
