"""Deciding one command against a partition's state (commands.handling), without Kafka."""

from __future__ import annotations

from typing import Any

from commands.errors import gone
from commands.handling import PartitionState, handle
from commands.messages import CommandMessage, LogPosition
from commands.references import NoReferences

NOW = 1_800_000_000.0


def msg(name: str, aggregate_type: str, data: dict[str, Any], **kw: Any) -> CommandMessage:
    fields: dict[str, Any] = {
        "command_id": "cmd-1",
        "name": name,
        "aggregate_type": aggregate_type,
        "aggregate_id": "a1",
        "expected_version": None,
        "data": data,
        "reply_to": "api-1",
        "deadline": NOW + 10,
        "correlation_id": "corr",
        "subject": "s",
    }
    fields.update(kw)
    return CommandMessage(**fields)


class FakeKeys:
    """Seals by wrapping (`sealed(<subject>):<value>`); an erased subject's seal is `gone`."""

    def __init__(self) -> None:
        self.erased: list[str] = []

    def seal(self, subject: str, data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        if subject in self.erased:
            raise gone(f"{subject} was erased")
        return {k: f"sealed({subject}):{v}" if k in fields else v for k, v in data.items()}

    def erase(self, subject: str) -> None:
        self.erased.append(subject)


def run(m: CommandMessage, part: PartitionState, keys: FakeKeys | None = None) -> Any:
    ids = iter(f"e{i}" for i in range(100))
    return handle(m, part, NoReferences(), lambda: NOW, lambda: next(ids), keys or FakeKeys())


REGISTER = {"name": "Ada", "email": "ada@example.com"}


def test_accepted_command_gets_versions_envelopes_and_updates_state() -> None:
    part = PartitionState()
    out = run(msg("register-customer", "customer", REGISTER), part)
    assert out.status == 201
    assert out.body["version"] == 1 and out.body["events"][0]["type"] == "CustomerRegistered"
    [env] = out.events
    assert (env.aggregate_id, env.version, env.event_id, env.causation_id) == (
        "a1",
        1,
        "e0",
        "cmd-1",
    )
    assert env.occurred_at == "2027-01-15T08:00:00Z"
    assert part.aggregates[("customer", "a1")].version == 1
    out = run(msg("rename-customer", "customer", {"name": "Ada L"}), part)
    assert out.body["version"] == 2 and part.aggregates[("customer", "a1")].version == 2


def test_personal_fields_are_sealed_and_an_erasure_destroys_the_key_before_its_event() -> None:
    part, keys = PartitionState(), FakeKeys()
    [registered] = run(msg("register-customer", "customer", REGISTER), part, keys).events
    assert registered.data == {
        "name": "sealed(customer:a1):Ada",
        "email": "sealed(customer:a1):ada@example.com",
    }
    out = run(msg("erase-customer", "customer", {}), part, keys)
    assert out.status == 201 and [e.type for e in out.events] == ["CustomerErased"]
    assert keys.erased == ["customer:a1"]
    out = run(msg("rename-customer", "customer", {"name": "Bo"}), part, keys)
    assert (out.status, out.body["error"]["code"], out.events) == (410, "gone", [])
    # A key erased while the state says otherwise (its erasure's transaction did not commit):
    # the seal refuses, and the state does not move.
    again, keys = PartitionState(), FakeKeys()
    run(msg("register-customer", "customer", REGISTER), again, keys)
    keys.erased.append("customer:a1")
    out = run(msg("rename-customer", "customer", {"name": "Bo"}), again, keys)
    assert (out.status, out.events, again.aggregates[("customer", "a1")].version) == (410, [], 1)


def test_expired_command_is_refused_without_events() -> None:
    part = PartitionState()
    out = run(msg("register-customer", "customer", REGISTER, deadline=NOW - 1), part)
    assert (out.status, out.body["error"]["code"], out.events) == (504, "timeout", [])
    assert part.aggregates == {}


def test_version_conflict_and_not_found_leave_state_alone() -> None:
    part = PartitionState()
    out = run(msg("rename-customer", "customer", {"name": "X"}), part)
    assert (out.status, out.body["error"]["code"]) == (404, "not_found")
    run(msg("register-customer", "customer", REGISTER), part)
    out = run(msg("rename-customer", "customer", {"name": "X"}, expected_version=5), part)
    assert (out.status, out.body["error"]["code"]) == (409, "version_conflict")
    assert out.body["error"]["details"] == [{"expected_version": 5, "actual_version": 1}]
    assert part.aggregates[("customer", "a1")].version == 1


def test_processor_revalidates_data_it_did_not_validate_itself() -> None:
    out = run(msg("register-customer", "customer", {"name": "", "email": "nope"}), PartitionState())
    assert out.status == 422
    assert {d["field"] for d in out.body["error"]["details"]} == {"data.name", "data.email"}


def test_command_name_must_match_the_aggregate_type() -> None:
    out = run(msg("register-customer", "book", REGISTER), PartitionState())
    assert out.status == 404


def test_idempotency_replays_same_request_and_refuses_a_different_one() -> None:
    from commands.handling import IdempotencyRecord

    part = PartitionState()
    part.idempotency["k"] = IdempotencyRecord("fp-1", 201, {"version": 1}, NOW)
    same = run(
        msg("register-customer", "customer", REGISTER, idempotency_key="k", fingerprint="fp-1"),
        part,
    )
    assert (same.status, same.body, same.replay, same.events) == (201, {"version": 1}, True, [])
    other = run(
        msg("register-customer", "customer", REGISTER, idempotency_key="k", fingerprint="fp-2"),
        part,
    )
    assert (other.status, other.body["error"]["code"]) == (422, "idempotency_key_reused")


def test_position_tokens_round_trip_and_reject_garbage() -> None:
    p = LogPosition("events.order", 3, 12345)
    assert LogPosition.parse(p.token()) == p
    for bad in ["", "!!!", "WyJhIl0", p.token()[:-3]]:
        try:
            LogPosition.parse(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_a_key_is_remembered_for_the_retention_then_forgotten_and_memory_shrinks() -> None:
    from commands.handling import IDEMPOTENCY_RETENTION_S, IdempotencyRecord

    part = PartitionState()
    day = 24 * 3600.0
    for i, age in enumerate([8 * day, 7 * day + 1, 7 * day - 1, day]):
        part.idempotency[f"k{i}"] = IdempotencyRecord("fp", 201, {"version": 1}, NOW - age)
    kept = run(
        msg("register-customer", "customer", REGISTER, idempotency_key="k2", fingerprint="fp"),
        part,
    )
    assert kept.replay and kept.status == 201  # 1 s inside the retention: replayed
    assert list(part.idempotency) == ["k2", "k3"]  # the two older ones are gone from memory
    again = run(
        msg("register-customer", "customer", REGISTER, idempotency_key="k1", fingerprint="fp"),
        part,
    )
    assert not again.replay and again.status == 201 and again.events  # forgotten: decided anew
    assert part.idempotency["k1"].at == NOW  # and remembered from now on
    assert 7 * day == IDEMPOTENCY_RETENTION_S


def test_a_restored_processor_knows_the_same_keys_as_one_that_kept_running() -> None:
    from commands.handling import IdempotencyRecord

    day = 24 * 3600.0
    records = {
        f"k{i}": IdempotencyRecord("fp", 201, {}, NOW - age)
        for i, age in enumerate([9 * day, 7 * day + 1, 3 * day, 60.0])
    }
    running = PartitionState(idempotency=dict(records))
    running.forget_expired(NOW)
    restored = PartitionState()
    for key, record in records.items():  # what the topic may still hold (deletes are lazy)
        restored.remember(key, record, NOW)
    assert list(restored.idempotency) == list(running.idempotency) == ["k2", "k3"]
