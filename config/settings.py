"""All configuration, from the environment (`LOGFOLD_*`, plus the usual `KAFKA_BOOTSTRAP_SERVERS`
and `DATABASE_URL`). Unset Kafka/Postgres addresses mean "start local ones" under `logfold run`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.logs import level_of

# A Kafka consumer's request unanswered this long fails and is retried (kafka-python waits 305 s).
KAFKA_REQUEST_TIMEOUT_MS = 30_000
# How long a Kafka consumer's poll waits when there is nothing to read. A record that arrives
# ends the wait at once (the broker answers a fetch as soon as it has one), so this sets only
# how often an idle loop wakes, looks around and polls again: CPU at idle, not latency.
IDLE_POLL_MS = 500
# How often the projector writes its status (spark/status.py); /health calls it silent after
# three of these are missed.
PROJECTOR_BEAT_S = 5.0
# The projector's JVM with the quick JIT compiler alone (micro-batches: `projector_jvm_options`).
# Alone, C1 sizes the code cache as for no tiers, 48 MiB: a rebuild handed to such a projector
# filled it ("Out of space in CodeCache for adapters") and the JVM ended; kept at tiered
# compilation's 240 MiB.
C1_ALONE = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
# How long changelogs keep every change, and then deletes (LOGFOLD_CDC_COMPACTION_LAG_MS,
# LOGFOLD_CDC_DELETE_RETENTION_MS): a day each.
CHANGELOG_KEEP_MS = 24 * 3600 * 1000
# A changelog's segments roll at least this often and are compacted at most this long after
# their compaction lag: an erased subject's older records are gone from the changelogs within
# the lag and this (guarantee 27; the active segment is never compacted).
CHANGELOG_SEGMENT_MS = 3600 * 1000
# Tokens: the audience (`aud`) each must name, and the longest lifetime (`exp` - `iat`) the API
# accepts; `logfold token` issues them so (LOGFOLD_JWT_AUDIENCE, LOGFOLD_JWT_MAX_TTL_S).
JWT_AUDIENCE = "logfold-api"
JWT_MAX_TTL_S = 24 * 3600

# The largest record batch a Logfold topic takes: the broker's default `message.max.bytes`, which
# every topic inherits (stack/topics.py sets no `max.message.bytes`).
KAFKA_MAX_BATCH_BYTES = 1_048_588
# What one fetch asks for at most: per partition, and in all (a catch-up reads several
# partitions from their start, a few MB each round trip).
KAFKA_PARTITION_FETCH_BYTES = 4 * 1024 * 1024
KAFKA_FETCH_BYTES = 16 * 1024 * 1024
# A fetch response's headers (per topic and partition: ids, offsets, aborted transactions),
# beside its records; generous, since the bound only guards against a corrupt length.
KAFKA_RESPONSE_HEADERS_BYTES = 1024 * 1024
# How long a kafka-python client waits before it tries a broker it lost again: from the first
# wait to the longest, doubling (with jitter) in between. The longest is the Java client's.
KAFKA_RECONNECT_BACKOFF_MS = 50
KAFKA_RECONNECT_BACKOFF_MAX_MS = 1000


def kafka_client_options() -> dict[str, int]:
    """The connection settings every kafka-python client of Logfold's takes: producers and admin
    clients as `**kafka_client_options()`, consumers within `**kafka_consumer_options()`.

    A client that has lost a broker waits longer and longer before it tries it again, up to
    `reconnect_backoff_max_ms`: 30 s in kafka-python (1 s in Kafka's Java client). With that,
    a client came back to a restarted broker up to half a minute after it was up again: the API
    answered commands `503` for 11-14 s after its broker had returned."""
    return {
        "reconnect_backoff_ms": KAFKA_RECONNECT_BACKOFF_MS,
        "reconnect_backoff_max_ms": KAFKA_RECONNECT_BACKOFF_MAX_MS,
    }


def kafka_consumer_options() -> dict[str, int]:
    """What every kafka-python consumer of Logfold's takes (`**kafka_consumer_options()`): the
    connection settings of every client and the fetch bounds."""
    return {**kafka_client_options(), **kafka_fetch_bounds()}


def kafka_fetch_bounds() -> dict[str, int]:
    """The fetch settings every kafka-python consumer of Logfold's takes (within
    `kafka_consumer_options()`).

    kafka-python refuses a response larger than `receive_message_max_bytes` (1,000,000 by
    default, below its own default fetch sizes of 1 MiB a partition and 50 MB in all): it closes
    the connection with `InvalidReceiveError: Invalid frame length`, and every request in flight
    on it fails. The broker answers a fetch with at most `fetch_max_bytes` of records, or with one
    batch larger than that (at most KAFKA_MAX_BATCH_BYTES) when the first one is; so a frame
    bound above both, with room for the headers, is never reached by a well-formed response."""
    return {
        "max_partition_fetch_bytes": KAFKA_PARTITION_FETCH_BYTES,
        "fetch_max_bytes": KAFKA_FETCH_BYTES,
        "receive_message_max_bytes": (
            max(KAFKA_FETCH_BYTES, KAFKA_MAX_BATCH_BYTES) + KAFKA_RESPONSE_HEADERS_BYTES
        ),
    }


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
    # (docs/benchmarks-journal.md), and the same at 50 commands/s.
    api_workers: int = Field(default=2, ge=1)
    # How an API process serves: `gevent`, a greenlet per connection (tens of thousands of
    # sockets in one process, ~30 KiB each; docs/benchmarks-journal.md, "serving many
    # sockets"), or `gthread`, an OS thread per connection (an open websocket or server-sent
    # events stream holds one, up to `api_threads`).
    api_worker: Literal["gevent", "gthread"] = "gevent"
    api_threads: int = Field(default=512, ge=8)  # gthread: per process
    api_connections: int = Field(default=12_000, ge=64)  # gevent: connections per process
    # Threads (gevent: connections) of an API process that websockets never take: REST keeps
    # answering however many sockets are open.
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
    # The projector's JVM (with local Spark); unset, chosen by the live paths' mode (see
    # `projector_jvm_options`).
    projector_java_options: str | None = None
    # Every Spark driver JVM maps the classes Spark loads from the archive `make bootstrap`
    # made (spark/class_archive.py): it starts seconds sooner. Off, it loads them from the jars.
    spark_class_archive: bool = True
    # At its start, the projector runs its batch job this many times on made-up events of every
    # type (`EventSink.warm`): Spark generates and the JIT compiles the folds' code before the
    # first command needs it. 0: no warm-up, a start seconds shorter and the first commands'
    # views that much later.
    projector_warm_up_rounds: int = Field(default=3, ge=0, le=10)
    # Once started, the projector rehearses a rebuild of its projections on about this many
    # records of the log (the first of each partition), writing nothing (`Rebuild.rehearse`):
    # Spark generates and the JIT compiles a rebuild's code, so the first `logfold rebuild`
    # handed to it runs nearly as fast as its later ones. 0: no rehearsal.
    projector_rebuild_rehearsal_records: int = Field(default=50000, ge=0)
    # The event pipeline's live path in Spark's real-time mode (each event on its own, as it
    # arrives; `docs/design.md`); off, or without a task slot per partition it reads (a local
    # master is given them), it folds in micro-batches.
    spark_realtime: bool = True
    # How long the real-time query's Kafka fetches wait for a record when there is none (a
    # record ends the wait at once): longer asks the broker less often while idle, and holds
    # up the query's epoch boundary (every 30 minutes) by as much at most.
    spark_realtime_fetch_wait_ms: int = Field(default=500, ge=1, le=10_000)
    # Under load, the projector's real-time paths gather what their rows topics get into one
    # Postgres transaction per interval at most (`spark.realtime.Pace`): each transaction's own
    # cost (progress rows, its commit, their changelog records) is then paid for many commands,
    # not a few. Only while records come faster than `projector_batch_above_per_s`: slower,
    # each is applied as soon as it comes. 0: each poll as it returns, at every rate.
    projector_apply_interval_ms: int = Field(default=100, ge=0, le=1000)
    projector_batch_above_per_s: float = Field(default=100, ge=0)

    # A changed projection's deploy (guarantee 25, docs/operations.md): how many earlier
    # versions of each projection are kept (a copy of their tables) so that rolling back to
    # one folds only the events since it was swapped out; 0 keeps none. With verify, a build
    # compares the new version with the live one before its swap and records what differs.
    keep_versions: int = Field(default=1, ge=0)
    deploy_verify: bool = False

    cdc_slot: str | None = None  # default: logfold_cdc_<database>
    # How long a changelog (`cdc.<table>`) keeps every change before compaction may drop the
    # ones a later change of their key supersedes (`min.compaction.lag.ms`), and how long a
    # delete's tombstone stays after that (`delete.retention.ms`). A reader further behind than
    # that finds changes gone: the websocket hub then resyncs the table's subscribers, a join
    # rebuilds. Both must cover the websocket history (`ws_replay` changes of a table, and how
    # long a client may stay away and resume with `since`) and the joins' worst lag (a
    # projector down). The topic check at start refuses smaller values (larger ones are fine).
    cdc_compaction_lag_ms: int = Field(default=CHANGELOG_KEEP_MS, ge=0)
    cdc_delete_retention_ms: int = Field(default=CHANGELOG_KEEP_MS, ge=0)
    # The largest changelog record CDC sends (a row with its before-image): kafka-python's
    # `max_request_size`, Kafka's own default. A larger row stops CDC at it (nothing after it is
    # sent, none is lost) until this and the topic's `max.message.bytes` are raised.
    cdc_max_record_bytes: int = Field(default=1024 * 1024, ge=1024)

    ws_max_subscriptions: int = Field(default=20, ge=1)  # per connection
    ws_max_per_subject: int = Field(default=100, ge=1)  # open websockets per token subject
    ws_auth_timeout_s: float = Field(default=5.0, gt=0)  # a socket without a token is closed
    # Sockets that came without a valid `?token=` wait for an `auth` message outside the
    # admitted ones, in a pool of their own: at most this many per process, and per client
    # address (behind a load balancer that hides clients' addresses, raise the latter).
    ws_max_pending: int = Field(default=32, ge=1)
    ws_max_pending_per_address: int = Field(default=8, ge=1)
    # Subscribes per connection: a burst, then so many a second (each takes a snapshot).
    ws_subscribe_burst: int = Field(default=20, ge=1)
    ws_subscribes_per_s: float = Field(default=2.0, gt=0)
    # Reads and subscriptions waiting for `consistent_with` at once, per process and per token
    # subject; past them, `429` with Retry-After.
    max_waiters: int = Field(default=64, ge=1)
    max_waiters_per_subject: int = Field(default=8, ge=1)
    ws_max_message_bytes: int = Field(default=16 * 1024, ge=256)  # client -> server
    ws_buffer: int = Field(default=1000, ge=2)  # messages queued per client before 4008
    ws_buffer_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)  # and their bytes
    ws_snapshot_rows: int = Field(default=10_000, ge=1)
    ws_heartbeat_s: float = Field(default=10.0, gt=0)
    ws_replay: int = Field(default=10_000, ge=0)  # recent changes kept per table for `since`
    ws_socket_buffer_bytes: int = Field(default=256 * 1024, ge=4096)

    # Webhooks (`logfold webhooks`, docs/webhooks.md). Outbound calls reach only public
    # addresses: loopback, link-local and private ones (and IPv4 ones mapped into IPv6) are
    # refused, checked on the address actually connected to, unless this allows them (tests,
    # a receiver on the same private network).
    webhook_allow_private: bool = False
    # How long one delivery is retried (exponential backoff with full jitter, from
    # `webhook_backoff_base_s` doubling up to `webhook_backoff_cap_s` between attempts) before
    # it goes to the endpoint's dead letters, and how long an endpoint may fail without a
    # single success before it is paused with a reason (Svix's figures: a day, five days).
    webhook_retry_window_s: float = Field(default=24 * 3600.0, gt=0)
    webhook_backoff_base_s: float = Field(default=2.0, gt=0)
    webhook_backoff_cap_s: float = Field(default=3600.0, gt=0)
    webhook_pause_after_s: float = Field(default=5 * 24 * 3600.0, gt=0)
    # How long a replayed dead letter is retried before it is a dead letter again.
    webhook_replay_window_s: float = Field(default=300.0, gt=0)
    # Each outbound request: the TCP (and TLS) connect, then each wait for the response, and
    # the whole request; at most `webhook_max_response_bytes` of the answer are read (none of
    # it matters but its status).
    webhook_connect_timeout_s: float = Field(default=5.0, gt=0)
    webhook_timeout_s: float = Field(default=15.0, gt=0)
    webhook_max_response_bytes: int = Field(default=64 * 1024, ge=0)
    # How often the dispatcher looks for endpoints created, paused, resumed or deleted through
    # the API when no notification told it sooner (the API notifies it at once).
    webhook_poll_s: float = Field(default=5.0, gt=0)

    jwt_secret: str | None = None
    jwt_audience: str = Field(default=JWT_AUDIENCE, min_length=1)
    jwt_max_ttl_s: int = Field(default=JWT_MAX_TTL_S, ge=60)
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
    # What each process logs (config/logs.py): `info` is what an operator needs, `debug` brings
    # the libraries' chatter, Spark's warnings and the output of processes as they stop.
    log_level: str = "info"
    log_format: Literal["json", "text"] = "json"  # `logfold run`'s processes: text

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level_of(value)  # ValueError names the levels there are
        return value.strip().lower()

    @property
    def ws_max_open(self) -> int:
        """Authenticated websockets one API process holds at most: the threads (gevent:
        connections) it neither reserves for REST nor keeps for sockets waiting for their
        `auth` message."""
        held = self.api_connections if self.api_worker == "gevent" else self.api_threads
        return max(held - self.api_reserved_threads - self.ws_max_pending, 1)

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

    def projector_jvm_options(self) -> str:
        """`LOGFOLD_PROJECTOR_JAVA_OPTIONS`, or what suits the live paths' mode. In real-time
        mode, long-lived tasks fold every event with code compiled once: with the optimising
        JIT compiler (C2) beside the quick one (C1), the JVM spent half the CPU per event under
        load, and the whole pipeline sustained 400 commands/s against 350 on 2 cores. With
        micro-batches, each batch is planned anew and C2 spent a third of a core recompiling
        Spark's planner: C1 alone halved a view's lag there (docs/benchmarks-journal.md)."""
        if self.projector_java_options is not None:
            return self.projector_java_options
        return "" if self.spark_realtime else C1_ALONE

    def database(self) -> str:
        if not self.database_url:
            raise RuntimeError(
                "DATABASE_URL is not set; run `logfold run` to start a local Postgres "
                "or point DATABASE_URL at one (postgresql://user:pass@host:port/db)"
            )
        return self.database_url


def slot_name(settings: Settings) -> str:
    """`LOGFOLD_CDC_SLOT`, or one per database (slot names are global to the server). The
    database is named by either login: the API may be given only its own."""
    if settings.cdc_slot:
        return settings.cdc_slot
    url = settings.database_url or settings.api_database()
    database = urlparse(url).path.lstrip("/") or "postgres"
    return ("logfold_cdc_" + re.sub(r"[^a-z0-9_]", "_", database.lower()))[:63]


def sqlalchemy_url(database_url: str) -> str:
    """`database_url` as SQLAlchemy names it, with psycopg (3) as the driver."""
    for prefix in ("postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix) :]
    return database_url
