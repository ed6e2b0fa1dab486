"""Health of the components the API depends on.

`HealthChecks` knows how to check each component once. `HealthMonitor` runs those checks in the
background, one at a time, every `health_interval_s`; `/health` and `/metrics` only read its last
results (with their age), so a busy API answers at once and stays ready (guarantee 17). A
component that was up is reported down only after `health_failures` consecutive failed checks,
so one slow answer on a loaded machine does not make an orchestrator restart a healthy service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from app.read_model import ReadModel
from config.settings import (
    PROJECTOR_BEAT_S,
    Settings,
    kafka_client_options,
    kafka_consumer_options,
    slot_name,
)
from config.topics import Topics

if TYPE_CHECKING:
    from app.hub import Hub

log = logging.getLogger(__name__)

Status = dict[str, Any]
Check = Callable[[], dict[str, Status]]

STALE_S = 60.0
# Keys of a status that may name hosts, ports or data: for the logs and `admin` callers only.
PRIVATE = ("error", "master", "first_parked_error", "build_error")


class HealthChecks:
    """One check per component; each returns its status or raises. Kafka clients are kept
    between checks (a new client per check would cost more than the check)."""

    def __init__(
        self,
        settings: Settings,
        read_model: ReadModel | None = None,
        timeout: float = 3.0,
        hub: Hub | None = None,
    ) -> None:
        self.settings, self.timeout, self.read_model = settings, timeout, read_model
        self.hub = hub  # the websocket hub: its component `live` (its own state, no I/O)
        self.topics = Topics(settings.topic_prefix)
        self._admin_client: KafkaAdminClient | None = None
        self._consumer: KafkaConsumer | None = None

    def checks(self) -> dict[str, Check]:
        """Each check by name, returning one or more components (projections: one each)."""
        checks: dict[str, Check] = {
            "kafka": lambda: {"kafka": self.kafka()},
            "postgres": lambda: {"postgres": self.postgres()},
            "command_processing": lambda: {"command_processing": self.command_processing()},
            "cdc": lambda: {"cdc": self.cdc()},
        }
        if self.hub is not None:
            hub = self.hub
            checks["live"] = lambda: {"live": hub.health()}
        if self.read_model is not None:
            checks["projections"] = lambda: {
                f"projection:{name}": status for name, status in self.projections().items()
            }
            checks["projector"] = self.projector
        return checks

    def reset(self) -> None:
        """Forget the kept Kafka clients (after a failure or a check that did not answer)."""
        admin, consumer, self._admin_client, self._consumer = (
            self._admin_client,
            self._consumer,
            None,
            None,
        )
        for client in (admin, consumer):
            if client is not None:
                try:
                    client.close()
                except Exception:  # closing a client of a broker that is gone
                    log.debug("closing a health check's Kafka client", exc_info=True)

    def projections(self) -> dict[str, Status]:
        """A projection (or join) is up unless it failed (a transform or a row raised: the
        error and the offsets it could not get past are shown; the others go on) or it is
        behind and has not advanced for STALE_S seconds."""
        assert self.read_model is not None
        each = {}
        for name, lag in self.read_model.lag().items():
            # While a new version is built beside the live tables, they may not move (when no
            # projector of their version runs): the view serves, and it says so.
            building = "building_version" in lag
            stale = lag["events"] > 0 and lag["seconds"] > STALE_S and not building
            status = "failed" if "failed" in lag else "down" if stale else "up"
            each[name] = {
                "status": status,
                "lag_events": lag["events"],
                "lag_seconds": lag["seconds"],
                "late_events": lag["late_events"],
                # Records deleted from the log before it applied them: the view never had
                # them (spark/gaps.py); a rebuild cannot bring them back either.
                "lost_offsets": lag["lost_offsets"],
            }
            if "data_loss" in lag:
                each[name]["data_loss"] = lag["data_loss"]
            # Events parked behind one its fold could not apply (guarantee 26): the view is
            # up, and behind for those aggregates only.
            for key in ("parked_events", "parked_aggregates", "skipped_events"):
                if key in lag:
                    each[name][key] = lag[key]
            if "first_parked_error" in lag:
                each[name]["first_parked_error"] = lag["first_parked_error"]
            for key in (
                "version",
                "building_version",
                "build_started_at",
                "build_done",
                "build_total",
                "build_report",
                "build_error",
            ):
                if key in lag:
                    each[name][key] = lag[key]
            if "counted" in lag:  # figures its views declare (`View.counted`)
                each[name]["counted"] = lag["counted"]
            if "failed" in lag:
                each[name].update(
                    error=lag["failed"]["error"],
                    failed_at_offsets=lag["failed"]["offsets"],
                    failed_at=lag["failed"]["at"],
                )
        return each

    def projector(self) -> dict[str, Status]:
        """The projector's own status (spark/status.py), when one runs: down when it has not
        written it for three beats (stopped, hung, cut off from Postgres) or has no Spark
        executor left (its queries cannot run: a cluster's workers are gone); up otherwise,
        saying which queries fold in micro-batches and why (fewer task slots than real-time
        mode needs, for one)."""
        assert self.read_model is not None
        row = self.read_model.projector_status()
        if row is None:
            return {}
        silent = row["age_s"] > 3 * PROJECTOR_BEAT_S
        status: Status = {
            "status": "down" if silent or row["executors"] == 0 else "up",
            "master": row["master"],
            "executors": row["executors"],
            "slots": row["slots"],
            "slots_needed": row["slots_needed"],
            "queries": row["queries"],
            "reported_seconds_ago": round(row["age_s"], 1),
        }
        if silent:
            status["error"] = (
                f"the projector has not reported for {row['age_s']:.0f} s: it stopped, hangs, "
                "or cannot reach Postgres (its log says which)"
            )
        elif row["executors"] == 0:
            status["error"] = (
                f"the projector has no Spark executor: its queries cannot run until a worker "
                f"of {row['master']} takes it on (start one, or see the master's UI)"
            )
        return {"projector": status}

    def cdc(self) -> Status:
        """The replication slot: is a CDC process attached, how far behind it is (bytes of WAL
        not yet confirmed, and seconds by the server's own measure), and how much WAL the slot
        makes the server keep. `wal_status` `lost` means the slot fell beyond
        `max_slot_wal_keep_size`: drop it (`logfold cdc --drop-slot`) and start CDC again."""
        slot = slot_name(self.settings)
        with psycopg.connect(
            self.settings.api_database(), connect_timeout=self._connect_s()
        ) as conn:
            row = conn.execute(
                "SELECT s.active, s.wal_status, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint, "
                # flush lag from pg_stat_replication, which the API's login may not read
                # (it shows every session's details): a function of migration 0012 answers.
                "s.safe_wal_size, logfold_slot_flush_lag(s.slot_name) "
                "FROM pg_replication_slots s WHERE s.slot_name = %s",
                (slot,),
            ).fetchone()
        if row is None:
            return {"status": "down", "slot": slot, "error": "no replication slot: start CDC"}
        active, wal_status, lag, retained, safe, seconds = row
        up = active and wal_status in ("reserved", "extended")
        return {
            "status": "up" if up else "down",
            "slot": slot,
            "active": active,
            "wal_status": wal_status,
            "lag_bytes": lag,
            "lag_seconds": round(seconds or 0.0, 3),
            "retained_wal_bytes": retained,
            "wal_left_before_slot_is_lost_bytes": safe,
        }

    def _connect_s(self) -> int:
        return max(int(self.timeout), 1)  # libpq takes whole seconds

    def _admin(self) -> KafkaAdminClient:
        if self._admin_client is None:
            self._admin_client = KafkaAdminClient(
                bootstrap_servers=self.settings.kafka(),
                **kafka_client_options(),
                request_timeout_ms=int(self.timeout * 1000),
                client_id="logfold-health",
            )
        return self._admin_client

    def _end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.settings.kafka(),
                metrics_enabled=False,
                request_timeout_ms=int(self.timeout * 1000),
                client_id="logfold-health",
                **kafka_consumer_options(),
            )
        ends: dict[TopicPartition, int] = self._consumer.end_offsets(tps)
        return ends

    def kafka(self) -> Status:
        brokers = self._admin().describe_cluster()["brokers"]
        return {"status": "up", "brokers": len(brokers)}

    def postgres(self) -> Status:
        with psycopg.connect(
            self.settings.api_database(), connect_timeout=self._connect_s()
        ) as conn:
            conn.execute("SELECT 1")
        return {"status": "up"}

    def command_processing(self) -> Status:
        """Up when the processor group has members; lag = commands not yet processed."""
        admin = self._admin()
        group = self.topics.processor_group
        described = admin.describe_consumer_groups([group])
        members = sum(len(g.members) for g in described if g.group == group)
        committed = admin.list_consumer_group_offsets(group)
        tps = [TopicPartition(self.topics.commands, p) for p in range(self.settings.partitions)]
        end = self._end_offsets(tps)
        lag = sum(max(end[tp] - (committed[tp].offset if tp in committed else 0), 0) for tp in tps)
        return {"status": "up" if members else "down", "processors": members, "lag_events": lag}


class _Component:
    """What is known of one component: the last status shown, and the failures since."""

    def __init__(self, status: Status, at: float) -> None:
        self.shown, self.shown_at = status, at
        self.failures = 0 if status["status"] == "up" else 1

    def observe(self, status: Status, at: float, threshold: int) -> None:
        if status["status"] == "up":
            self.shown, self.shown_at, self.failures = status, at, 0
            return
        self.failures += 1
        # Still up until enough checks in a row failed; a component never seen up is shown
        # as it is (at start-up, nothing is hidden).
        if self.failures >= threshold or self.shown["status"] != "up":
            self.shown, self.shown_at = status, at


class HealthMonitor:
    """Runs every check in a background thread, one at a time, every `interval` seconds, and
    keeps what `/health` shows. `start()` is idempotent: the API starts it at the first request
    that asks (an API that nobody polls checks nothing); stopped with `stop()`."""

    def __init__(
        self,
        checks: HealthChecks,
        interval: float = 2.0,
        failures: int = 3,
    ) -> None:
        self.checks, self.interval, self.failures = checks, interval, failures
        self._components: dict[str, _Component] = {}
        self._round_at: float | None = None  # when the last round ended
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._first_round = threading.Event()
        self._stopping = threading.Event()
        self._running: dict[str, threading.Thread] = {}  # checks that have not answered yet
        self._started_at: dict[str, float] = {}
        self._reported: dict[str, set[str]] = {}  # each check's components at its last answer

    def start(self) -> None:
        with self._lock:
            if self._started.is_set():
                return
            self._started.set()
        threading.Thread(target=self._loop, name="health-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self.checks.reset()

    def snapshot(self, wait: float = 0.0) -> dict[str, Status]:
        """The components as last checked, each with `age_seconds`; `wait` bounds how long to
        wait for the very first round (a freshly started process)."""
        if wait:
            self._first_round.wait(wait)
        now = time.monotonic()
        with self._lock:
            if not self._components:
                return {"health_checks": {"status": "down", "error": "not checked yet"}}
            out = {
                name: {**c.shown, "age_seconds": round(now - c.shown_at, 3)}
                for name, c in self._components.items()
            }
            round_at = self._round_at
        # The monitor itself: results older than a few rounds mean its thread is stuck or gone.
        limit = max(3 * (self.interval + self.checks.timeout * len(self.checks.checks())), 30.0)
        if round_at is not None and now - round_at > limit:
            out["health_checks"] = {"status": "down", "error": "the health checks stopped"}
        return out

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self.round()
            self._first_round.set()
            self._stopping.wait(self.interval)

    def round(self) -> None:
        """Every check once, in turn; each bounded by the checks' timeout."""
        for name, check in self.checks.checks().items():
            if self._stopping.is_set():
                return
            observed = self._run(name, check)
            now = time.monotonic()
            with self._lock:
                # A component its check no longer reports is gone (a projector stopped on
                # purpose), not frozen at what it last was.
                for gone in self._reported.get(name, set()) - set(observed):
                    self._components.pop(gone, None)
                self._reported[name] = set(observed)
                for component, status in observed.items():
                    known = self._components.get(component)
                    if known is None:
                        self._components[component] = _Component(status, now)
                    else:
                        was = known.shown["status"]
                        known.observe(status, now, self.failures)
                        if known.shown["status"] != was:
                            log.warning(
                                "health: %s is %s (was %s)%s",
                                component,
                                known.shown["status"],
                                was,
                                f": {status['error']}" if "error" in status else "",
                            )
        with self._lock:
            self._round_at = time.monotonic()

    def _run(self, name: str, check: Check) -> dict[str, Status]:
        """The check's components, or each of them down with why (it raised or did not answer
        in time). A check still running from an earlier round is not started twice."""
        previous = self._running.get(name)
        if previous is not None and previous.is_alive():
            return self._failed(
                name, f"the previous check has not answered after {self._age(name)}"
            )
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["ok"] = check()
            except Exception as e:
                result["error"] = str(e) or type(e).__name__

        thread = threading.Thread(target=run, name=f"health-{name}", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(self.checks.timeout)
        if thread.is_alive():
            self._running[name] = thread
            self._started_at[name] = started
            self.checks.reset()  # the hung check keeps its clients; the next ones get new ones
            return self._failed(name, f"no answer in {self.checks.timeout:g}s")
        if "error" in result:
            self.checks.reset()
            log.debug("health check %s failed: %s", name, result["error"])
            return self._failed(name, result["error"])
        ok: dict[str, Status] = result["ok"]
        return ok

    def _age(self, name: str) -> str:
        return f"{time.monotonic() - self._started_at.get(name, time.monotonic()):.0f}s"

    def _failed(self, name: str, error: str) -> dict[str, Status]:
        """`name`'s components down with `error`: the check's own, or (projections) every
        component it reported before."""
        with self._lock:
            known = [c for c in self._components if c.startswith("projection:")]
        targets = known if name == "projections" and known else [name]
        return {t: {"status": "down", "error": error} for t in targets}


def public(components: dict[str, Status]) -> dict[str, Status]:
    """What an unauthenticated caller sees: statuses and figures, no error texts (they can name
    hosts, ports and data; they are in the logs and shown to `admin` callers)."""
    return {
        name: {k: v for k, v in status.items() if k not in PRIVATE}
        for name, status in components.items()
    }


def public_lag(lag: dict[str, Any]) -> dict[str, Any]:
    """A fold's lag (`ReadModel.lag`) as a caller without `admin` sees it: that it failed and
    where, how many offsets were lost and events parked, but not the failure's text, the
    parked events' first error nor the lost ranges (the texts can quote an event's data; all
    are in the logs and shown to `admin` callers)."""
    shown = {k: v for k, v in lag.items() if k not in ("data_loss", *PRIVATE)}
    if "failed" in shown:
        shown["failed"] = {k: v for k, v in shown["failed"].items() if k != "error"}
    return shown
