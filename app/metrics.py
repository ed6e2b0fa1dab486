"""Prometheus metrics of one API process (its own registry, so apps in tests do not collide)."""

from __future__ import annotations

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

    def count(self, command: str, status: int) -> None:
        self.commands.labels(command, str(status)).inc()

    def observe(self, command: str, seconds: float) -> None:
        self.latency.labels(command).observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
