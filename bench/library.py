"""The same write as Logfold's `rename-customer`, done with the `eventsourcing` library (its
Postgres adapter, in-process, no HTTP): load the customer, check the expected version, append
a `Renamed` event. The comparison `bench/commands.py load` prints beside its own figures."""

from __future__ import annotations

import contextlib
import os
import statistics
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event

from bench.loadgen import closed_loop, rounds


class Customer(Aggregate):
    @event("Registered")
    def __init__(self, name: str, email: str) -> None:
        self.name, self.email = name, email

    @event("Renamed")
    def rename(self, name: str) -> None:
        self.name = name


class VersionConflict(Exception):
    pass


class Customers(Application[uuid.UUID]):
    def register(self, name: str, email: str) -> uuid.UUID:
        customer = Customer(name, email)
        self.save(customer)
        return customer.id

    def rename(self, customer_id: uuid.UUID, name: str, expected_version: int | None) -> int:
        customer: Customer = self.repository.get(customer_id)
        if expected_version is not None and customer.version != expected_version:
            raise VersionConflict(f"at {customer.version}, expected {expected_version}")
        customer.rename(name)
        self.save(customer)
        return int(customer.version)


def application(database_url: str, threads: int) -> Customers:
    url = urlsplit(database_url)
    return Customers(
        env={
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_DBNAME": url.path.lstrip("/"),
            "POSTGRES_HOST": url.hostname or "127.0.0.1",
            "POSTGRES_PORT": str(url.port or 5432),
            "POSTGRES_USER": url.username or "",
            "POSTGRES_PASSWORD": url.password or "",
            "POSTGRES_POOL_SIZE": str(threads),
            "POSTGRES_SCHEMA": "public",
            "CREATE_TABLE": "y",
        }
    )


def renames_per_s(app: Customers, ids: list[uuid.UUID], threads: int, seconds: float) -> float:
    """Closed loop: `threads` threads renaming customers as fast as they can, each going round
    its own share of `ids`, each rename checking the version read before: with one customer
    per thread, the library would replay a longer history at every load."""
    versions: dict[uuid.UUID, int | None] = dict.fromkeys(ids)
    next_for = rounds(ids, threads)

    def rename(t: int) -> None:
        customer = next_for(t)
        versions[customer] = app.rename(customer, "n", versions[customer])

    return closed_loop(threads, seconds, rename)


def measure(
    database_url: str, repeats: int, seconds: float, long_events: int, customers: int = 200
) -> dict[str, Any]:
    """Renames/s with 1 and 4 threads on `customers` customers, and with 1 thread on one with
    `long_events` events (the library replays them on every load: no snapshots configured);
    with Postgres's default durability (each commit waits for its WAL flush) and with
    `synchronous_commit=off` (acknowledged before the disk, as a Kafka broker acknowledges
    by default)."""
    out: dict[str, Any] = {}
    for durable in (True, False):
        suffix = "" if durable else "_async_commit"
        with _pgoptions("" if durable else "-c synchronous_commit=off"):
            for threads in (1, 4):
                app = application(database_url, threads)
                ids = [app.register(f"c{i}", f"c{i}@example.com") for i in range(customers)]
                out[f"{threads}_thread_per_s{suffix}"] = statistics.median(
                    renames_per_s(app, ids, threads, seconds) for _ in range(repeats)
                )
                app.close()
            app = application(database_url, 1)
            long = Customer("long", "long@example.com")
            for i in range(long_events - 1):
                long.rename(f"n{i}")
            app.save(long)  # all its events in one go
            out[f"{long_events}_event_aggregate_per_s{suffix}"] = statistics.median(
                renames_per_s(app, [long.id], 1, seconds) for _ in range(repeats)
            )
            app.close()
    return out


@contextlib.contextmanager
def _pgoptions(options: str) -> Iterator[None]:
    """Server settings for the connections opened meanwhile (libpq reads PGOPTIONS)."""
    before = os.environ.get("PGOPTIONS")
    os.environ["PGOPTIONS"] = options
    try:
        yield
    finally:
        if before is None:
            del os.environ["PGOPTIONS"]
        else:
            os.environ["PGOPTIONS"] = before
