"""Writing changes into a captured table with plain SQL, and checking what consumers saw.

Rows of `customers` get a `version` bumped by one on each update, so a consumer's sequence of
versions for a key shows every gap and every duplicate."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from kafka import KafkaConsumer, TopicPartition

from cdc.changes import Change, from_record
from config.settings import Settings, kafka_consumer_options
from config.topics import Topics


def insert_customers(settings: Settings, keys: list[str], name: str) -> None:
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        for key in keys:
            conn.execute(
                "INSERT INTO customers (customer_id, name, email, registered_at, version) "
                "VALUES (%s, %s, %s, now(), 0)",
                (key, name, f"{key}@example.com"),
            )


def table_versions(settings: Settings, keys: list[str]) -> dict[str, int]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT customer_id, version FROM customers WHERE customer_id = ANY(%s)", (keys,)
        ).fetchall()
    return {k: int(v) for k, v in rows}


class Writer:
    """Bumps the version of `keys`, round robin, one transaction each, until stopped or
    `total` updates are made."""

    def __init__(
        self,
        settings: Settings,
        keys: list[str],
        total: int | None = None,
        rate: float | None = None,  # updates per second; None: as fast as Postgres goes
    ) -> None:
        self.settings, self.keys, self.total, self.rate = settings, keys, total, rate
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        started = time.monotonic()
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            while not self._stop.is_set() and (self.total is None or self.done < self.total):
                if self.rate is not None:  # pace the load (not a wait for a condition)
                    ahead = self.done / self.rate - (time.monotonic() - started)
                    if ahead > 0:
                        self._stop.wait(ahead)
                key = self.keys[self.done % len(self.keys)]
                conn.execute(
                    "UPDATE customers SET version = version + 1 WHERE customer_id = %s", (key,)
                )
                self.done += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def run(self, timeout: float = 120) -> None:
        """Make all `total` updates, then return."""
        self._thread.start()
        self.wait(timeout)

    def wait(self, timeout: float = 120) -> None:
        self._thread.join(timeout=timeout)
        assert not self._thread.is_alive(), "the writer did not finish"


def versions_seen(messages: list[dict[str, Any]], key: str = "customer_id") -> dict[str, list[int]]:
    """Per key: the version in the snapshot (if any), then the version of each change."""
    seen: dict[str, list[int]] = {}
    for m in messages:
        if m["type"] == "snapshot":
            seen = {r[key]: [r["version"]] for r in m["rows"]}
        elif m["type"] == "change" and m["op"] == "upsert":
            seen.setdefault(m["key"][key], []).append(m["row"]["version"])
    return seen


def assert_consecutive(seen: dict[str, list[int]], final: dict[str, int]) -> None:
    """Every key went through every version up to its final one, once, in order."""
    for key, want in final.items():
        got = seen.get(key, [])
        assert got, f"{key}: nothing received"
        assert got == list(range(got[0], want + 1)), f"{key}: {got} (final {want})"


def changelog(settings: Settings, table: str) -> list[Change]:
    """Every record of `cdc.<table>`, in order (resends included)."""
    tp = TopicPartition(Topics(settings.topic_prefix).cdc(table), 0)
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(), enable_auto_commit=False, **kafka_consumer_options()
    )
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek_to_beginning(tp)
        out: list[Change] = []
        while consumer.position(tp) < end:
            for records in consumer.poll(timeout_ms=1000).values():
                out += [from_record(table, r.key, r.value, list(r.headers or ())) for r in records]
        return out
    finally:
        consumer.close()


def distinct(changes: list[Change]) -> list[Change]:
    """The changelog without resends: each position once, in order."""
    out: list[Change] = []
    seen = set()
    for c in changes:
        if not out or c.position > out[-1].position:
            out.append(c)
            seen.add(c.position)
        else:
            assert c.position in seen, f"{c.position} is out of order and not a resend"
    return out


def slot_ready(settings: Settings) -> bool:
    """Whether CDC has created the deployment's slot and sent its first snapshot (changes made
    before that are in the snapshot, not one by one)."""
    from config.settings import slot_name

    with psycopg.connect(settings.database()) as conn:
        found = conn.execute(
            "SELECT 1 FROM cdc_slots WHERE slot = %s", (slot_name(settings),)
        ).fetchone()
    return found is not None


def check_once(settings: Settings, keys: list[str], messages: list[dict[str, object]]) -> None:
    """`messages` (a subscription's, over one or more connections) hold every change of the
    `keys`' rows exactly once, in order, ending at the table's state."""
    from tests.wsclient import fold

    final = table_versions(settings, keys)
    rows = fold(messages, "customer_id")  # type: ignore[arg-type]
    assert {k: r["version"] for k, r in rows.items()} == final
    assert_consecutive(versions_seen(messages), final)  # type: ignore[arg-type]
    # The same sequence as the changelog (without CDC's resends) after the first snapshot.
    logged: dict[str, list[int]] = {}
    for change in distinct(changelog(settings, "customers")):
        if change.row is not None and change.key["customer_id"] in final:
            logged.setdefault(change.key["customer_id"], []).append(change.row["version"])
    seen = versions_seen(messages)  # type: ignore[arg-type]
    for key, versions in seen.items():
        assert logged[key][-len(versions) :] == versions, key


def check_resumed(
    settings: Settings, keys: list[str], client: Any, earlier: list[dict[str, object]]
) -> None:
    """Once the writes are done: `client` (subscription `s`, resumed with `since` after the
    connections that got `earlier`) catches up with the table, without a new snapshot, and
    every change came exactly once over all the connections."""
    from tests.wsclient import fold

    final = table_versions(settings, keys)

    def caught_up() -> bool:
        rows = fold(earlier + client.of("s"), "customer_id")
        return {k: r["version"] for k, r in rows.items()} == final

    client.wait_for(caught_up, "the resumed client to see every change", 120)
    resumed = client.of("s")
    assert not [m for m in resumed if m["type"] in ("snapshot", "resync")], "not resumed"
    check_once(settings, keys, earlier + resumed)
