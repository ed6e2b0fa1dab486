"""Health of the components the API depends on, each checked with a bounded timeout."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from app.read_model import ReadModel
from cdc.capture import slot_name
from stack.settings import Settings
from stack.topics import Topics

Status = dict[str, Any]

STALE_S = 60.0


class HealthChecks:
    def __init__(
        self, settings: Settings, read_model: ReadModel | None = None, timeout: float = 3.0
    ) -> None:
        self.settings, self.timeout, self.read_model = settings, timeout, read_model
        self.topics = Topics(settings.topic_prefix)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")

    def run(self) -> dict[str, Status]:
        checks = {
            "kafka": self.kafka,
            "postgres": self.postgres,
            "command_processing": self.command_processing,
            "cdc": self.cdc,
        }
        if self.read_model is not None:
            checks["projections"] = self.projections
        futures = {name: self._pool.submit(fn) for name, fn in checks.items()}
        deadline = time.monotonic() + self.timeout
        results: dict[str, Status] = {}
        for name, future in futures.items():
            try:
                results[name] = future.result(timeout=max(deadline - time.monotonic(), 0.01))
            except FutureTimeout:
                results[name] = {"status": "down", "error": f"no answer in {self.timeout:g}s"}
            except Exception as e:
                results[name] = {"status": "down", "error": str(e) or type(e).__name__}
        if "projections" in results:  # one component per projection, as API.md asks
            each = results.pop("projections")
            for name, status in each.get("each", {}).items():
                results[f"projection:{name}"] = status
            if "each" not in each:
                results["projections"] = each
        return results

    def projections(self) -> Status:
        """A projection (or join) is up unless it failed (a transform or a row raised: the
        error and the offsets it could not get past are shown; the others go on) or it is
        behind and has not advanced for STALE_S seconds."""
        assert self.read_model is not None
        each = {}
        for name, lag in self.read_model.lag().items():
            stale = lag["events"] > 0 and lag["seconds"] > STALE_S
            status = "failed" if "failed" in lag else "down" if stale else "up"
            each[name] = {
                "status": status,
                "lag_events": lag["events"],
                "lag_seconds": lag["seconds"],
                "late_events": lag["late_events"],
            }
            if "failed" in lag:
                each[name].update(
                    error=lag["failed"]["error"],
                    failed_at_offsets=lag["failed"]["offsets"],
                    failed_at=lag["failed"]["at"],
                )
        return {"each": each}

    def cdc(self) -> Status:
        """The replication slot: is a CDC process attached, how far behind it is (bytes of WAL
        not yet confirmed, and seconds by the server's own measure), and how much WAL the slot
        makes the server keep. `wal_status` `lost` means the slot fell beyond
        `max_slot_wal_keep_size`: drop it (`logfold cdc --drop-slot`) and start CDC again."""
        slot = slot_name(self.settings)
        with psycopg.connect(self.settings.database(), connect_timeout=int(self.timeout)) as conn:
            row = conn.execute(
                "SELECT s.active, s.wal_status, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint, "
                "s.safe_wal_size, extract(epoch FROM r.flush_lag)::float8 "
                "FROM pg_replication_slots s "
                "LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid "
                "WHERE s.slot_name = %s",
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

    def _admin(self) -> KafkaAdminClient:
        return KafkaAdminClient(
            bootstrap_servers=self.settings.kafka(), request_timeout_ms=int(self.timeout * 1000)
        )

    def kafka(self) -> Status:
        admin = self._admin()
        try:
            brokers = admin.describe_cluster()["brokers"]
            return {"status": "up", "brokers": len(brokers)}
        finally:
            admin.close()

    def postgres(self) -> Status:
        with psycopg.connect(self.settings.database(), connect_timeout=int(self.timeout)) as conn:
            conn.execute("SELECT 1")
        return {"status": "up"}

    def command_processing(self) -> Status:
        """Up when the processor group has members; lag = commands not yet processed."""
        admin = self._admin()
        group = self.topics.processor_group
        try:
            described = admin.describe_groups([group]).get(group, {})
            members = len(described.get("members", []))
            committed = admin.list_group_offsets({group: None}).get(group, {})
        finally:
            admin.close()
        consumer = KafkaConsumer(
            bootstrap_servers=self.settings.kafka(), request_timeout_ms=int(self.timeout * 1000)
        )
        try:
            tps = [TopicPartition(self.topics.commands, p) for p in range(self.settings.partitions)]
            end = consumer.end_offsets(tps)
        finally:
            consumer.close()
        lag = sum(max(end[tp] - (committed[tp].offset if tp in committed else 0), 0) for tp in tps)
        return {"status": "up" if members else "down", "processors": members, "lag_events": lag}
