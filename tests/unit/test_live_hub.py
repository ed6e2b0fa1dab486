"""The hub's bookkeeping without Kafka: what each subscription gets, history for `since`,
resends, rebuilds, and the bounded outbox of a slow client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from kafka import TopicPartition

from app import hub as hub_module
from app.hub import SLOW_CLOSE, Client, Hub, Subscription, Unservable
from cdc.changes import Change, Snapshot, WalPosition, record_for, widen
from events.base import ERASED


def _hub(replay: int = 100) -> Hub:
    return Hub("unused:9092", {"orders": "cdc.orders", "projection_progress": "cdc.pp"}, replay)


def _change(
    lsn: int, key: str, row: dict[str, Any] | None, before: dict[str, Any] | None = None
) -> Change:
    op = "delete" if row is None else ("update" if before else "insert")
    return Change("orders", op, {"order_id": key}, row, before, WalPosition(lsn, 1))  # type: ignore[arg-type]


def _sub(client: Client, **filter: Any) -> Subscription:
    return Subscription("s", "orders", "orders", "orders", filter, client)


def _taken(client: Client) -> list[dict[str, Any]]:
    """What the client's socket would be sent, decoded (changes are queued as their text)."""
    return [json.loads(m) if isinstance(m, str) else m for m in client.take(0) or []]


def test_rows_entering_and_leaving_a_filter_are_upserts_and_deletes() -> None:
    hub, client = _hub(), Client(100)
    hub.subscribe(_sub(client, customer_id="c1"), WalPosition(0, 0))
    paid = {"order_id": "o1", "customer_id": "c1", "status": "paid"}
    moved = {"order_id": "o1", "customer_id": "c2", "status": "paid"}
    hub._apply("orders", [_change(10, "o1", paid)])
    hub._apply("orders", [_change(11, "o1", moved, before=paid)])  # leaves the filter
    hub._apply("orders", [_change(12, "o2", {"order_id": "o2", "customer_id": "c2"})])  # never in
    hub._apply("orders", [_change(13, "o1", None, before=moved)])  # deleted outside the filter
    got = _taken(client)
    assert [(m["op"], m["key"], m["position"]) for m in got] == [
        ("upsert", {"order_id": "o1"}, "10.1"),
        ("delete", {"order_id": "o1"}, "11.1"),
    ]
    assert got[1]["row"] is None


def test_resends_are_dropped_and_history_serves_since() -> None:
    hub, client = _hub(replay=3), Client(100)
    for lsn in range(1, 6):
        hub._apply("orders", [_change(lsn, f"o{lsn}", {"order_id": f"o{lsn}"})])
    hub._apply("orders", [_change(4, "o4", {"order_id": "o4"})])  # a CDC resend
    hub.subscribe(_sub(client), WalPosition(3, 1))
    assert [m["position"] for m in _taken(client)] == ["4.1", "5.1"]
    with pytest.raises(Unservable):  # 1 and 2 were pushed out of the 3-change history
        hub.subscribe(_sub(Client(100)), WalPosition(1, 1))


def test_an_erasure_is_never_preceded_by_an_older_change_in_a_replay() -> None:
    """Guarantee 27: older changes may hold an erased subject's fields in clear; a `since`
    from before the erasure gets `resync` (then a snapshot), a later one the rest."""
    hub, client = _hub(), Client(100)
    hub._apply("orders", [_change(1, "o1", {"order_id": "o1", "customer_name": "Eve"})])
    hub._apply("orders", [_change(2, "o2", {"order_id": "o2", "customer_name": "Bo"})])
    hub._apply("orders", [_change(3, "o1", {"order_id": "o1", "customer_name": ERASED})])
    hub._apply("orders", [_change(4, "o2", {"order_id": "o2", "customer_name": "Bob"})])
    with pytest.raises(Unservable):
        hub.subscribe(_sub(Client(100)), WalPosition(1, 1))
    hub.subscribe(_sub(client), WalPosition(3, 1))
    assert [m["position"] for m in _taken(client)] == ["4.1"]


def test_snapshot_first_then_history_after_its_position_then_live() -> None:
    hub, client = _hub(), Client(100)
    hub._apply("orders", [_change(5, "o5", {"order_id": "o5"})])
    hub._apply("orders", [_change(7, "o7", {"order_id": "o7"})])
    snapshot = {"type": "snapshot", "id": "s", "rows": [], "position": "6.0"}
    hub.subscribe(_sub(client), WalPosition(6, 0), snapshot)
    hub._apply("orders", [_change(6, "late", {"order_id": "late"})])  # below: in the snapshot
    hub._apply("orders", [_change(8, "o8", {"order_id": "o8"})])
    assert [m.get("position") for m in _taken(client)] == ["6.0", "7.1", "8.1"]


def test_a_new_generation_resyncs_that_projections_subscribers() -> None:
    hub, client = _hub(), Client(100)
    sub = _sub(client)
    hub.subscribe(sub, WalPosition(0, 0))

    def progress(lsn: int, generation: int) -> Change:
        row = {"projection": "orders", "generation": generation}
        return Change(
            "projection_progress",
            "update",
            {"projection": "orders"},
            row,
            None,
            WalPosition(lsn, 1),
        )

    hub._apply("projection_progress", [progress(1, 0), progress(2, 0)])
    assert _taken(client) == []
    hub._apply("projection_progress", [progress(3, 1)])
    assert [m["type"] for m in _taken(client)] == ["resync", "_resubscribe"]
    hub._apply("orders", [_change(4, "o1", {"order_id": "o1"})])
    assert _taken(client) == []  # out of the stream until its new snapshot


def test_a_slow_client_is_warned_at_half_then_closed_and_its_outbox_dropped() -> None:
    client = Client(10)
    for i in range(5):
        assert client.offer({"type": "change", "n": i}, "s")
    assert client.outbox[-1] == {"type": "lagging", "id": "s", "behind": 5}
    for i in range(4):
        client.offer({"type": "change", "n": i}, "s")
    assert not client.offer({"type": "change"}, "s")  # the 11th: over the limit
    assert client.close_code == SLOW_CLOSE
    assert list(client.outbox) == [{"type": "lagging", "id": "s", "behind": 5}]
    assert client.peak == 10
    assert client.take(0) == [{"type": "lagging", "id": "s", "behind": 5}]
    assert client.take(0) is None  # then the connection closes with 4008
    assert not client.offer({"type": "change"}, "s")


def test_a_client_that_keeps_up_is_warned_again_only_after_catching_up() -> None:
    client = Client(8)
    for i in range(4):
        client.offer({"type": "change", "n": i}, "s")
    assert len(_taken(client)) == 5  # four changes and one warning
    for i in range(4):
        client.offer({"type": "change", "n": i}, "s")
    assert [m["type"] for m in _taken(client)][-1] == "lagging"


def test_the_outbox_is_bounded_in_bytes_too() -> None:
    client = Client(1000, buffer_bytes=100_000)
    assert client.offer({"type": "snapshot", "rows": []}, "s", weight=30_000)
    assert client.offer({"type": "change"}, "s", weight=25_000)  # past half: warned
    assert [m["type"] for m in client.outbox] == ["snapshot", "change", "lagging"]
    assert client.queued_bytes >= 55_000
    assert not client.offer({"type": "change"}, "s", weight=50_000)  # would weigh > 100 kB
    assert client.close_code == SLOW_CLOSE
    assert client.queued_bytes < 1000  # what it could not read is dropped


def test_a_change_weighs_its_changelog_record() -> None:
    hub, client = _hub(), Client(1000, buffer_bytes=64 * 1024)
    hub.subscribe(_sub(client), WalPosition(0, 0))
    row = {"order_id": "o1", "note": "x" * 40_000}
    big = Change("orders", "insert", {"order_id": "o1"}, row, None, WalPosition(1, 1), 40_100)
    hub._apply("orders", [big])
    assert client.close_code is None and client.warned  # 40 kB queued: past half of 64 kB
    hub._apply(
        "orders",
        [Change("orders", "update", {"order_id": "o1"}, row, row, WalPosition(2, 1), 40_100)],
    )
    assert client.close_code == SLOW_CLOSE


def _tx(lsn: int, key: str, xid: int | None) -> Change:
    return Change(
        "orders", "insert", {"order_id": key}, {"order_id": key}, None, WalPosition(lsn, 1), xid=xid
    )


def test_a_snapshot_hands_off_by_transaction_not_by_position() -> None:
    """The rows were read in a snapshot that saw transactions below 100 and 104, not 102
    (running then) nor 105 and later: the stream brings exactly the changes of those, in
    commit order, wherever their commit falls in the WAL."""
    hub, client = _hub(), Client(100)
    hub._apply("orders", [_tx(1, "before", 99), _tx(2, "running", 102), _tx(3, "seen", 104)])
    seen = Snapshot(100, 105, frozenset({102}))
    hub.subscribe(_sub(client), seen, {"type": "snapshot", "id": "s", "position": str(seen)})
    hub._apply("orders", [_tx(4, "late-but-seen", 103), _tx(5, "after", 107)])
    got = [m.get("key", {}).get("order_id") or m["type"] for m in _taken(client)]
    assert got == ["snapshot", "running", "after"]


def test_a_snapshot_needs_every_transaction_it_does_not_see_in_the_history() -> None:
    hub = _hub(replay=2)
    hub._apply("orders", [_tx(1, "a", 90), _tx(2, "b", 101), _tx(3, "c", 102), _tx(4, "d", 103)])
    # 90 and 101 fell out of the history: a snapshot with xmin 101 might not see 101.
    with pytest.raises(Unservable):
        hub.subscribe(_sub(Client(100)), Snapshot(101, 104, frozenset()))
    hub.subscribe(_sub(Client(100)), Snapshot(102, 104, frozenset()))  # 101 is in it


def test_a_snapshot_covers_another_when_it_sees_every_transaction_the_other_sees() -> None:
    slot = Snapshot(100, 105, frozenset({102}))  # saw below 100, 100, 101, 103, 104
    assert Snapshot(200, 210, frozenset()).covers(slot)  # far later: by the bounds alone
    assert Snapshot(102, 106, frozenset({102})).covers(slot)  # 102 still running: not in either
    assert Snapshot(100, 105, frozenset({102})).covers(slot)  # the same
    assert not Snapshot(90, 99, frozenset()).covers(slot)  # earlier
    assert not Snapshot(100, 105, frozenset({103})).covers(slot)  # 103 running for it
    assert not Snapshot(98, 104, frozenset()).covers(slot)  # 104 not started for it
    assert not Snapshot(1, 2 + (1 << 21), frozenset()).covers(
        Snapshot(1 << 21, 1 + (1 << 21), frozenset())
    )


def test_readers_of_the_table_from_before_the_cdc_slot_take_a_new_snapshot() -> None:
    """The first rows of a CDC slot hold the table as of the slot's snapshot; what changed
    before it was never streamed. A subscription whose rows were read earlier cannot tell what
    it missed: it gets `resync` (then a new snapshot), and such a snapshot is not served; one
    read later gets what its snapshot does not see, as ever."""
    hub, early, late = _hub(), Client(100), Client(100)
    before = Snapshot(50, 52, frozenset())  # read before the slot: o1 at version 1
    hub.subscribe(_sub(early), before, {"type": "snapshot", "id": "s", "position": str(before)})
    slot = Snapshot(60, 61, frozenset())
    first = [
        Change(
            "orders",
            "insert",
            {"order_id": o},
            {"order_id": o, "version": 3},
            None,
            WalPosition(500, n),
            snapshot=slot,
        )
        for n, o in enumerate(("o1", "o2"), start=1)
    ]
    hub._apply("orders", first)
    assert [m["type"] for m in _taken(early)] == ["snapshot", "resync", "_resubscribe"]
    assert hub.resyncs == 1
    with pytest.raises(Unservable):
        hub.subscribe(_sub(Client(100)), before)
    after = Snapshot(70, 72, frozenset({70}))
    hub.subscribe(_sub(late), after, {"type": "snapshot", "id": "s", "position": str(after)})
    hub._apply("orders", [_tx(501, "o3", 70), _tx(502, "o4", 71)])
    got = [m.get("key", {}).get("order_id") or m["type"] for m in _taken(late)]
    assert got == ["snapshot", "o3"]  # the slot's rows and 71 are in its snapshot
    # Resent by a restarted CDC process (the same slot): nothing breaks again.
    hub._apply("orders", first)
    assert hub.resyncs == 1 and _taken(late) == []


def test_a_slot_snapshot_travels_in_its_records() -> None:
    slot = Snapshot(60, 65, frozenset({61, 63}))
    change = Change(
        "orders",
        "insert",
        {"order_id": "o1"},
        {"order_id": "o1"},
        None,
        WalPosition(5, 1),
        snapshot=slot,
    )
    assert hub_module._decode("orders", _record(0, change)).snapshot == slot
    plain = _change(6, "o1", {"order_id": "o1"})
    assert hub_module._decode("orders", _record(1, plain)).snapshot is None


def test_transaction_ids_compare_across_the_32_bit_wraparound() -> None:
    epoch = 7 << 32
    around = Snapshot(epoch - 5, epoch + 5, frozenset({epoch - 2}))
    assert around.sees((epoch - 10) & 0xFFFFFFFF) and around.sees(3)
    assert not around.sees((epoch - 2) & 0xFFFFFFFF) and not around.sees(5)
    assert widen(2, epoch - 1) == epoch + 2 and widen(0xFFFFFFFF, epoch + 1) == epoch - 1
    assert Snapshot.parse(str(around)) == around
    for bad in ("", "1:2", "x:2:", "5:3:", "1:5:7", "0:1:"):
        with pytest.raises(ValueError):
            Snapshot.parse(bad)


# -- breaks in the history: records removed unread, or undecodable -------------------------------


@dataclass
class _Record:  # what the hub reads of a Kafka record
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def _record(offset: int, change: Change) -> _Record:
    key, value, headers = record_for(change, None)
    return _Record(offset, key, value, headers)


TP = TopicPartition("cdc.orders", 0)


def _following(replay: int = 100) -> tuple[Hub, Client, Subscription]:
    """A hub reading cdc.orders from offset 0, with one subscription from position 0."""
    hub, client = _hub(replay), Client(100)
    assert hub._resume("orders", TP, 0, 0) == 0
    sub = _sub(client)
    hub.subscribe(sub, WalPosition(0, 0))
    return hub, client, sub


def test_records_removed_before_the_hub_read_them_resync_its_subscribers() -> None:
    hub, client, _ = _following()
    hub._take("orders", TP, [_record(0, _change(1, "o1", {"order_id": "o1"}))])
    # Offsets 1 and 2 were removed (compacted, deleted) before the hub read them.
    hub._take("orders", TP, [_record(3, _change(4, "o4", {"order_id": "o4"}))])
    got = [m["type"] for m in _taken(client)]
    assert got == ["change", "resync", "_resubscribe"]  # o4 only once a new snapshot is taken
    assert hub.resyncs == 1 and hub.tables["orders"].next_offset == 4
    hub.subscribe(_sub(Client(100)), WalPosition(4, 1))  # from after the hole: served
    with pytest.raises(Unservable):  # from before it: what it missed is unknown
        hub.subscribe(_sub(Client(100)), WalPosition(1, 1))


def test_an_undecodable_record_is_counted_skipped_once_and_resyncs_its_subscribers() -> None:
    hub, client, _ = _following()
    good = _record(0, _change(1, "o1", {"order_id": "o1"}))
    poison = _Record(1, b"{", b"not json", [("xid", b"120")])
    hub._take("orders", TP, [good, poison, _record(2, _change(3, "o3", {"order_id": "o3"}))])
    assert [m["type"] for m in _taken(client)] == ["change", "resync", "_resubscribe"]
    assert hub.undecodable == 1 and hub.resyncs == 1
    assert hub.last_undecodable is not None
    assert {k: hub.last_undecodable[k] for k in ("topic", "partition", "offset")} == {
        "topic": "cdc.orders",
        "partition": 0,
        "offset": 1,
    }
    assert hub.tables["orders"].next_offset == 3  # past it: a restart never reads it again
    health = hub.health()
    assert health["status"] == "up" and health["undecodable_records"] == 1
    # A snapshot that might not see the undecodable record's transaction cannot be served.
    with pytest.raises(Unservable):
        hub.subscribe(_sub(Client(100)), Snapshot(110, 130, frozenset()))
    hub.subscribe(_sub(Client(100)), Snapshot(121, 130, frozenset()))
    for bad in (_Record(3, b"[1]", b'{"row": {}}', [("op", b"insert"), ("position", b"5.1")]),):
        hub._take("orders", TP, [bad])  # a key that is not an object: undecodable too
    assert hub.undecodable == 2


def test_a_restart_resumes_right_after_the_last_record_taken() -> None:
    hub, client, _ = _following(replay=2)
    hub._take(
        "orders", TP, [_record(i, _change(i + 1, f"o{i}", {"order_id": "x"})) for i in (0, 1)]
    )
    # The loop failed; 50 records came meanwhile: it goes on from offset 2, not from 50 - 2.
    assert hub._resume("orders", TP, 0, 52) == 2
    assert [m["type"] for m in _taken(client)] == ["change", "change"]
    # The log now starts at 10 (2..9 deleted unread): the history breaks, read what is left.
    assert hub._resume("orders", TP, 10, 52) == 10
    assert [m["type"] for m in _taken(client)] == ["resync", "_resubscribe"]
    assert hub._resume("orders", TP, 10, 52) == 10  # nothing read since: still there


def test_a_first_start_reads_the_last_replay_records() -> None:
    hub = _hub(replay=5)
    assert hub._resume("orders", TP, 0, 100) == 95
    with pytest.raises(Unservable):  # before the first record read: unknown
        hub.subscribe(_sub(Client(100)), WalPosition(1, 1))


def test_a_change_is_encoded_once_for_all_its_subscribers(monkeypatch: pytest.MonkeyPatch) -> None:
    hub, clients = _hub(), [Client(100) for _ in range(50)]
    for i, client in enumerate(clients):
        sub = Subscription(f"s{i}", "orders", "orders", "orders", {}, client)
        hub.subscribe(sub, WalPosition(0, 0))
    encoded: list[Any] = []
    real = hub_module.compact
    monkeypatch.setattr(hub_module, "compact", lambda v: encoded.append(v) or real(v))
    row = {"order_id": "o1", "title": "Été"}
    hub._apply("orders", [_change(10, "o1", row)])
    assert len(encoded) == 1  # one body, whatever the number of subscribers
    for i, client in enumerate(clients):
        (text,) = client.take(0) or []
        assert isinstance(text, str)
        assert json.loads(text) == {
            "type": "change",
            "id": f"s{i}",
            "op": "upsert",
            "key": {"order_id": "o1"},
            "row": row,
            "position": "10.1",
        }
        assert text.endswith(',"position":"10.1"}')  # last: found without decoding the rest
