"""Prometheus metrics of one API process (its own registry, so apps in tests do not collide)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.commands = Counter(
            "logfold_commands",
            "Commands answered, by command and HTTP status",
            ["command", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "logfold_command_seconds",
            "Time from request to command outcome",
            ["command"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.component_up = Gauge(
            "logfold_component_up",
            "1 when the component's last health check passed",
            ["component"],
            registry=self.registry,
        )
        self.component_lag = Gauge(
            "logfold_component_lag_events",
            "Records not yet processed by the component",
            ["component"],
            registry=self.registry,
        )

        self.lag_seconds = Gauge(
            "logfold_component_lag_seconds",
            "Seconds the component is behind the log",
            ["component"],
            registry=self.registry,
        )
        self.late_events = Gauge(
            "logfold_late_events",
            "Events later than the watermark, kept out of windows",
            ["component"],
            registry=self.registry,
        )

        self.lost = Gauge(
            "logfold_lost_offsets",
            "Log offsets removed from Kafka before the projection applied them",
            ["component"],
            registry=self.registry,
        )

        self.counted = Gauge(
            "logfold_view_rows",
            "Rows of a view meeting a condition it declares (e.g. payouts without an account)",
            ["component", "count"],
            registry=self.registry,
        )

        self.undecodable = Gauge(
            "logfold_undecodable_records",
            "Changelog records the websocket hub could not decode: each skipped, its table's "
            "subscribers resynced (see /health for the last one's place)",
            ["component"],
            registry=self.registry,
        )

        self.parked = Gauge(
            "logfold_parked_events",
            "Events a projection parked behind one its fold could not apply (see "
            "logfold dead-letters list)",
            ["component"],
            registry=self.registry,
        )

        self.failed = Gauge(
            "logfold_component_failed",
            "1 while the projection or join is stopped by an error (see /health for it)",
            ["component"],
            registry=self.registry,
        )

    def record_health(self, components: dict[str, dict[str, Any]]) -> None:
        for name, status in components.items():
            self.component_up.labels(name).set(1 if status["status"] == "up" else 0)
            if name.startswith("projection:"):
                self.failed.labels(name).set(1 if status["status"] == "failed" else 0)
            if "lag_events" in status:
                self.component_lag.labels(name).set(status["lag_events"])
            if "lag_seconds" in status:
                self.lag_seconds.labels(name).set(status["lag_seconds"])
            if "late_events" in status:
                self.late_events.labels(name).set(status["late_events"])
            if "lost_offsets" in status:
                self.lost.labels(name).set(status["lost_offsets"])
            if "parked_events" in status:
                self.parked.labels(name).set(status["parked_events"])
            if "undecodable_records" in status:
                self.undecodable.labels(name).set(status["undecodable_records"])
            for label, rows in status.get("counted", {}).items():
                self.counted.labels(name, label).set(rows)

    def count(self, command: str, status: int) -> None:
        self.commands.labels(command, str(status)).inc()

    def observe(self, command: str, seconds: float) -> None:
        self.latency.labels(command).observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
