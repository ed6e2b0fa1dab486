"""Kafka in KRaft mode from Apache Kafka's jars on Maven Central: one broker+controller node
(`LocalKafka`), or several on this machine (`KafkaCluster`: a controller quorum of three, every
topic replicated three times and written to at least two)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import threading
import uuid
from pathlib import Path

from config import jvm, maven
from config.settings import kafka_client_options
from stack.procs import port_open, stop_process, wait_until

POM = Path(__file__).parent / "kafka" / "pom.xml"
LOG4J = Path(__file__).parent / "kafka" / "log4j2.properties"


# The JVM's messages about the class archive (a class it cannot archive, jars that changed
# since it was made) are not the user's business: the archive is an optimisation.
QUIET_ARCHIVE = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")


def ensure_jars(lib_dir: Path) -> Path:
    """Fetch the pinned broker and its runtime jars with Maven unless already present."""
    return maven.fetch(POM, lib_dir / "kafka")


def archive_path(lib_dir: Path) -> Path:
    """Where the broker's class-data-sharing archive for this machine's JVM and these jars is
    (it may not exist): `make bootstrap` makes it (stack/class_archive.py). A broker's JVM maps
    the classes it loads from it, already parsed and verified: it is ready in about 0.6x the
    time and CPU. Another JVM or other jars find no archive, and start without one."""
    jars = sorted(p.name for p in (lib_dir / "kafka").glob("*.jar"))
    key = hashlib.sha256(" ".join([jvm.java(), *jars]).encode()).hexdigest()[:12]
    return lib_dir.resolve() / "kafka-cds" / f"kafka-{key}.jsa"


class LocalKafka:
    """One broker+controller process with its own data directory and ports; alone, or node
    `node_id` of a cluster (`voters`: every node's `id@host:controller_port`; `cluster_id`:
    the same for all)."""

    def __init__(
        self,
        lib_dir: Path,
        data_dir: Path,
        port: int,
        controller_port: int,
        config: tuple[str, ...] = (),
        node_id: int = 1,
        voters: str | None = None,
        cluster_id: str | None = None,
        class_archive: bool = True,
    ) -> None:
        self.config = config  # extra `key=value` lines of server.properties (they win)
        self.jars = ensure_jars(lib_dir).resolve()  # absolute: the archive records the path
        self.archive = archive_path(lib_dir) if class_archive else None
        self.java_options: tuple[str, ...] = ()  # the broker's own, beside those of `_java`
        self.data_dir = data_dir
        self.port = port
        self.controller_port = controller_port
        self.node_id = node_id
        self.voters = voters or f"{node_id}@127.0.0.1:{controller_port}"
        self.cluster_id = cluster_id or _new_cluster_id()
        self.nodes = self.voters.count(",") + 1
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _java(self, *args: str, heap: str = "256m", options: tuple[str, ...] = ()) -> list[str]:
        archive = self.archive
        mapped = (f"-XX:SharedArchiveFile={archive}", *QUIET_ARCHIVE)
        return [
            jvm.java(),
            f"-Xmx{heap}",
            *(mapped if archive is not None and archive.is_file() else ()),
            *options,
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
        # Alone: everything once. In a cluster: every topic (the internal ones too) on three
        # nodes, a write acknowledged by at least two, and no replica that missed writes ever
        # elected leader (it would drop what the others acknowledged).
        copies, isr = min(self.nodes, 3), min(self.nodes, 2)
        # Alone, the node is its own controller: a broker session guards nothing (a dead broker
        # is a dead controller), yet a broker restarted after a crash must wait out its old
        # session before it may register again (Kafka's default, 9 s, on every such restart).
        alone = (
            ["broker.session.timeout.ms=4000", "broker.heartbeat.interval.ms=1000"]
            if self.nodes == 1
            else []
        )
        conf.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    f"node.id={self.node_id}",
                    f"controller.quorum.voters={self.voters}",
                    f"listeners=PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{p}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                    f"log.dirs={self.data_dir / 'log'}",
                    "num.partitions=1",
                    f"offsets.topic.replication.factor={copies}",
                    "offsets.topic.num.partitions=4",
                    f"transaction.state.log.replication.factor={copies}",
                    f"transaction.state.log.min.isr={isr}",
                    "transaction.state.log.num.partitions=4",
                    f"share.coordinator.state.topic.replication.factor={copies}",
                    f"share.coordinator.state.topic.min.isr={isr}",
                    f"default.replication.factor={copies}",
                    f"min.insync.replicas={isr}",
                    "unclean.leader.election.enable=false",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=false",
                    "log.cleaner.backoff.ms=1000",
                    "transaction.abort.timed.out.transaction.cleanup.interval.ms=5000",
                    # No no-op record in the metadata log every 500 ms: they only feed the
                    # quorum's liveness metrics, and cost an idle broker a point of a core.
                    "metadata.max.idle.interval.ms=0",
                    *alone,
                    *self.config,
                    "",
                ]
            )
        )
        return conf

    def start(self, timeout: float = 90.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process (formatting its data directory the first time) without waiting:
        a cluster's nodes are all launched before any can be ready (a quorum needs two)."""
        formatting = self.format()  # (writes the node's configuration, each launch)
        if formatting is not None:
            _finished(formatting, "format Kafka's data directory")
        self.log = (self.data_dir / "broker.out").open("ab")
        self.proc = subprocess.Popen(
            self._java(
                "kafka.Kafka",
                str(self.data_dir / "server.properties"),
                heap="512m",
                options=self.java_options,
            ),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def format(self) -> subprocess.Popen[bytes] | None:
        """Start formatting the data directory if it never was (a JVM of its own, ~2 s): the
        caller waits for it."""
        conf = self._write_config()
        if (self.data_dir / "log" / "meta.properties").exists():
            return None
        return subprocess.Popen(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={self.cluster_id}",  # `=`: an id may start with "-"
                "-c",
                str(conf),
                "--ignore-formatted",
                # A tool that runs for a second: the quick compiler alone (2.4-2.9 CPU-s with
                # both compilers, 1.7 without the optimizing one).
                options=("-XX:TieredStopAtLevel=1",),
            ),
            stdout=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 90.0) -> None:
        wait_until(self._ready, timeout, f"Kafka on {self.bootstrap} (log: {self.log.name})")

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"Kafka exited with {self.proc.returncode}; see {self.data_dir}")
        if not port_open(self.port):
            return False
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(
            bootstrap_servers=self.bootstrap, **kafka_client_options(), request_timeout_ms=3000
        )
        try:
            brokers = admin.describe_cluster()["brokers"]
            return any(b["node_id"] == self.node_id for b in brokers)
        finally:
            admin.close()

    def kill(self) -> None:
        """`kill -9`: no shutdown, no flush; the data directory stays for a restart."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, and SIGKILL if it has not stopped within `timeout` s."""
        if self.proc is not None:
            stop_process(self.proc, timeout=timeout)
            self.proc = None


# How long a node of a cluster being stopped whole gets to stop by itself (measured: 6 s).
SHUTDOWN_S = 15.0


class KafkaCluster:
    """`size` broker+controller nodes on this machine, each with its own ports and data
    directory (`<data_dir>/node-<id>`), in one cluster."""

    def __init__(
        self,
        lib_dir: Path,
        data_dir: Path,
        ports: list[tuple[int, int]],  # each node's (client port, controller port)
        config: tuple[str, ...] = (),
    ) -> None:
        voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports, start=1))
        # Kept beside the nodes: a node formatted later (its directory lost) joins the same one.
        id_file = data_dir / "cluster-id"
        if not id_file.exists():
            data_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(_new_cluster_id())
        cluster_id = id_file.read_text().strip()
        self.nodes = [
            LocalKafka(lib_dir, data_dir / f"node-{i}", p, c, config, i, voters, cluster_id)
            for i, (p, c) in enumerate(ports, start=1)
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        return self.nodes[node_id - 1]

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Every node, without waiting: none can be ready before a quorum has started. The
        first time, their data directories are formatted side by side."""
        for formatting in [f for node in self.nodes if (f := node.format()) is not None]:
            _finished(formatting, "format Kafka's data directory")
        for node in self.nodes:
            node.launch()

    def wait_ready(self, timeout: float = 120.0) -> None:
        for node in self.nodes:
            node.wait_ready(timeout)

    def stop(self) -> None:
        """Stop every node at once: one by one, the last would wait out its controlled
        shutdown for a quorum that is already gone. Together they stop cleanly in a few
        seconds, unless a node's shutdown is approved only after the quorum went with the
        others; that one waits for nothing more, and is killed after SHUTDOWN_S (it recovers
        its files at its next start)."""
        stopping = [threading.Thread(target=node.stop, args=(SHUTDOWN_S,)) for node in self.nodes]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def _finished(proc: subprocess.Popen[bytes], what: str) -> None:
    if proc.wait() != 0:
        raise RuntimeError(f"could not {what} (exit {proc.returncode}): {proc.args!r}")


def _new_cluster_id() -> str:
    """KRaft cluster ids are 16 random bytes in URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
