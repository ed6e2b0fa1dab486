"""`logfold run`'s one line a minute: what the stack did (commands taken, view updates) and how
far behind it is (commands not yet processed, events not yet in the views), as `/health` sees it.

Cheap by design: per minute, one Kafka offsets request, one small query and one `/health`
(whose checks the API runs anyway)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import requests
from kafka import KafkaConsumer, TopicPartition

from config.settings import Settings, kafka_consumer_options
from config.topics import Topics

log = logging.getLogger("logfold")

EVERY_S = 60.0


@dataclass(frozen=True)
class Counts:
    commands: int  # records ever written to the commands topic
    view_updates: int  # events the folds have applied, summed over the folds


def line(before: Counts, now: Counts, health: dict[str, Any] | None) -> str:
    """The minute's line, from the counts at its start and end and `/health`'s answer."""
    commands = now.commands - before.commands
    updates = now.view_updates - before.view_updates
    said = f"last minute: {commands} commands, {updates} view updates"
    if health is None:
        return f"{said}; lag unknown (/health did not answer)"
    components: dict[str, dict[str, Any]] = health.get("components", {})
    processing = components.get("command_processing", {}).get("lag_events", "?")
    views = [c for name, c in components.items() if name.startswith("projection:")]
    behind = sum(int(c.get("lag_events", 0)) for c in views)
    seconds = max((float(c.get("lag_seconds", 0.0)) for c in views), default=0.0)
    said += f"; lag: {processing} commands, {behind} events in views ({seconds:.1f} s)"
    down = sorted(name for name, c in components.items() if c.get("status") != "up")
    return f"{said}; down: {', '.join(down)}" if down else said


class Pulse:
    """Logs `line` every `every` seconds, in a thread of its own, until `stop()`."""

    def __init__(
        self, settings: Settings, health_url: str, say: Callable[[str], object] = log.info
    ) -> None:
        self.settings, self.health_url, self.say = settings, health_url, say
        self.topics = Topics(settings.topic_prefix)
        self._stopping = threading.Event()
        self._consumer: KafkaConsumer | None = None
        self._thread = threading.Thread(target=self._run, name="pulse", daemon=True)

    def start(self, every: float = EVERY_S) -> None:
        self.every = every
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)

    def _run(self) -> None:
        before = self._counts_or_none()
        while not self._stopping.wait(self.every):
            now = self._counts_or_none()
            if before is not None and now is not None:
                self.say(line(before, now, self._health()))
            before = now
        if self._consumer is not None:
            self._consumer.close()

    def _counts_or_none(self) -> Counts | None:
        try:
            return self.counts()
        except Exception as e:  # a minute without a line; the processes log their own errors
            log.debug("pulse: counting failed: %s", e)
            return None

    def counts(self) -> Counts:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.settings.kafka(),
                metrics_enabled=False,
                client_id="logfold-run-pulse",
                request_timeout_ms=int(self.settings.kafka_timeout_s * 1000),
                **kafka_consumer_options(),
            )
        commands = self.topics.commands
        tps = [TopicPartition(commands, p) for p in range(self.settings.partitions)]
        ends = self._consumer.end_offsets(tps)
        with psycopg.connect(self.settings.database(), connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT coalesce(sum(events_applied), 0) FROM projection_progress"
            ).fetchone()
        return Counts(sum(int(o) for o in ends.values()), int(row[0]) if row else 0)

    def _health(self) -> dict[str, Any] | None:
        try:
            answer: dict[str, Any] = requests.get(self.health_url, timeout=5).json()
            return answer
        except (requests.RequestException, ValueError):
            return None
