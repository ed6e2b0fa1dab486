"""All configuration, from the environment (`LOGFOLD_*`, plus the usual `KAFKA_BOOTSTRAP_SERVERS`
and `DATABASE_URL`). Unset Kafka/Postgres addresses mean "start local ones" under `logfold run`."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# A Kafka consumer's request unanswered this long fails and is retried (kafka-python waits 305 s).
KAFKA_REQUEST_TIMEOUT_MS = 30_000
# How long a Kafka consumer's poll waits when there is nothing to read. A record that arrives
# ends the wait at once (the broker answers a fetch as soon as it has one), so this sets only
# how often an idle loop wakes, looks around and polls again: CPU at idle, not latency.
IDLE_POLL_MS = 500


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOGFOLD_", extra="ignore", populate_by_name=True)

    kafka_bootstrap_servers: str | None = Field(
        default=None,
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "LOGFOLD_KAFKA_BOOTSTRAP_SERVERS"),
    )
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "LOGFOLD_DATABASE_URL")
    )
    # The API's own login: a member of `logfold_reader` (migration 0007), which reads the views
    # and writes nothing. Unset: the API uses DATABASE_URL.
    api_database_url: str | None = None
    topic_prefix: str = ""
    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)

    home: Path = Path(".stack")
    data_dir: Path | None = None
    kafka_port: int = 19092
    postgres_port: int = 15432

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # API processes (gunicorn workers) of `logfold api` and `logfold run`: one process is held
    # to one core by Python's GIL; two served 17% more commands/s at saturation on 2 cores
    # (docs/benchmarks.md), and the same at 50 commands/s.
    api_workers: int = Field(default=2, ge=1)
    api_threads: int = Field(default=512, ge=8)  # per process; each open websocket holds one
    # Threads of an API process that websockets never take: REST keeps answering however many
    # sockets are open (at most api_threads - api_reserved_threads per process).
    api_reserved_threads: int = Field(default=64, ge=1)
    processors: int = Field(default=1, ge=1)

    spark_master: str = "local[*]"
    spark_shuffle_partitions: int = 2
    spark_driver_memory: str = "1g"
    spark_scratch_dir: str | None = None  # the projector's checkpoints; default /dev/shm
    # How long an idle streaming query waits before asking Kafka again for new records: the
    # event pipeline, and the joins (whose views already wait for CDC, so they poll less).
    spark_idle_poll_ms: int = Field(default=100, ge=1, le=5000)
    spark_joins_idle_poll_ms: int = Field(default=250, ge=1, le=5000)
    # The projector's JVM (with local Spark): its micro-batches are small and many, and the
    # optimising JIT compiler (C2) spent a third of a core recompiling Spark's planner while
    # they ran; the quick one alone halved a view's lag on 2 cores (docs/benchmarks.md).
    projector_java_options: str = "-XX:TieredStopAtLevel=1"
    # The event pipeline's live path in Spark's real-time mode (each event on its own, as it
    # arrives; `docs/design.md`); off, or without a task slot per partition it reads (a local
    # master is given them), it folds in micro-batches.
    spark_realtime: bool = True
    # How long the real-time query's Kafka fetches wait for a record when there is none (a
    # record ends the wait at once): longer asks the broker less often while idle, and holds
    # up the query's epoch boundary (every 30 minutes) by as much at most.
    spark_realtime_fetch_wait_ms: int = Field(default=500, ge=1, le=10_000)

    cdc_slot: str | None = None  # default: logfold_cdc_<database>

    ws_max_subscriptions: int = Field(default=20, ge=1)  # per connection
    ws_max_per_subject: int = Field(default=100, ge=1)  # open websockets per token subject
    ws_auth_timeout_s: float = Field(default=5.0, gt=0)  # a socket without a token is closed
    ws_max_message_bytes: int = Field(default=16 * 1024, ge=256)  # client -> server
    ws_buffer: int = Field(default=1000, ge=2)  # messages queued per client before 4008
    ws_buffer_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)  # and their bytes
    ws_snapshot_rows: int = Field(default=10_000, ge=1)
    ws_heartbeat_s: float = Field(default=10.0, gt=0)
    ws_replay: int = Field(default=10_000, ge=0)  # recent changes kept per table for `since`
    ws_socket_buffer_bytes: int = Field(default=256 * 1024, ge=4096)

    jwt_secret: str | None = None
    command_timeout_s: float = Field(default=10.0, gt=0)
    kafka_timeout_s: float = Field(default=5.0, gt=0)
    clock_skew_s: float = Field(default=1.0, ge=0)
    max_body_bytes: int = 64 * 1024
    retry_after_s: int = 5
    # /health: checks run in the background, one at a time, every `health_interval_s`, each
    # given `health_timeout_s`; a component that was up is down after `health_failures` in a row.
    health_interval_s: float = Field(default=2.0, gt=0)
    health_timeout_s: float = Field(default=3.0, gt=0)
    health_failures: int = Field(default=3, ge=1)
    log_level: str = "INFO"

    @property
    def ws_max_open(self) -> int:
        """Websockets one API process holds at most (the threads it does not reserve)."""
        return max(self.api_threads - self.api_reserved_threads, 1)

    @property
    def data_path(self) -> Path:
        return self.data_dir or self.home / "data"

    @property
    def lib_path(self) -> Path:
        return self.home / "lib"

    def kafka(self) -> str:
        if not self.kafka_bootstrap_servers:
            raise RuntimeError(
                "KAFKA_BOOTSTRAP_SERVERS is not set; run `logfold run` to start a local broker "
                "or point KAFKA_BOOTSTRAP_SERVERS at one"
            )
        return self.kafka_bootstrap_servers

    def api_database(self) -> str:
        return self.api_database_url or self.database()

    def database(self) -> str:
        if not self.database_url:
            raise RuntimeError(
                "DATABASE_URL is not set; run `logfold run` to start a local Postgres "
                "or point DATABASE_URL at one (postgresql://user:pass@host:port/db)"
            )
        return self.database_url
