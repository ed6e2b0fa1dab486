"""A single-node Kafka broker in KRaft mode, from Apache Kafka's jars on Maven Central."""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

from config import maven
from stack.procs import port_open, stop_process, wait_until

POM = Path(__file__).parent / "kafka" / "pom.xml"
LOG4J = Path(__file__).parent / "kafka" / "log4j2.properties"


def ensure_jars(lib_dir: Path) -> Path:
    """Fetch the pinned broker and its runtime jars with Maven unless already present."""
    return maven.fetch(POM, lib_dir / "kafka")


class LocalKafka:
    """One broker+controller process with its own data directory and ports."""

    def __init__(
        self,
        lib_dir: Path,
        data_dir: Path,
        port: int,
        controller_port: int,
        config: tuple[str, ...] = (),
    ) -> None:
        self.config = config  # extra `key=value` lines of server.properties (they win)
        self.jars = ensure_jars(lib_dir)
        self.data_dir = data_dir
        self.port = port
        self.controller_port = controller_port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _java(self, *args: str, heap: str = "256m") -> list[str]:
        return [
            "java",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J}",
            f"-Dkafka.logs.dir={self.data_dir / 'logs'}",
            "-cp",
            f"{self.jars}/*",
            *args,
        ]

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "server.properties"
        p, c = self.port, self.controller_port
        conf.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{c}",
                    f"listeners=PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{p}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                    f"log.dirs={self.data_dir / 'log'}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=4",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "transaction.state.log.num.partitions=4",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=false",
                    "log.cleaner.backoff.ms=1000",
                    "transaction.abort.timed.out.transaction.cleanup.interval.ms=5000",
                    # No no-op record in the metadata log every 500 ms: they only feed the
                    # quorum's liveness metrics, and cost an idle broker a point of a core.
                    "metadata.max.idle.interval.ms=0",
                    *self.config,
                    "",
                ]
            )
        )
        return conf

    def start(self, timeout: float = 90.0) -> None:
        conf = self._write_config()
        if not (self.data_dir / "log" / "meta.properties").exists():
            subprocess.run(
                self._java(
                    "kafka.tools.StorageTool",
                    "format",
                    f"--cluster-id={_new_cluster_id()}",  # `=`: an id may start with "-"
                    "-c",
                    str(conf),
                    "--ignore-formatted",
                ),
                check=True,
                stdout=subprocess.DEVNULL,
            )
        log = (self.data_dir / "broker.out").open("ab")
        self.proc = subprocess.Popen(
            self._java("kafka.Kafka", str(conf), heap="512m"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(self._ready, timeout, f"Kafka on {self.bootstrap} (log: {log.name})")

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"Kafka exited with {self.proc.returncode}; see {self.data_dir}")
        if not port_open(self.port):
            return False
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000)
        try:
            return bool(admin.describe_cluster()["brokers"])
        finally:
            admin.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)
            self.proc = None


def _new_cluster_id() -> str:
    """KRaft cluster ids are 16 random bytes in URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
