"""Deciding one command against a partition's in-memory state: no Kafka here.

`handle` is what a processor runs for each command it owns; it returns the outcome (status,
body, events) and updates the state in place. The processor then writes the events, the new
snapshots, the idempotency record and the reply in one Kafka transaction, and throws the state
away if that transaction does not commit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from commands.errors import Rejected, version_conflict
from commands.messages import CommandMessage, error_body
from commands.references import References
from commands.registry import AGGREGATES, COMMANDS
from commands.schemas import details
from events.serialization import Envelope, envelope_for, from_data, to_data

STATUS = {
    "not_found": 404,
    "rule_violated": 409,
    "version_conflict": 409,
    "gone": 410,
    "validation_failed": 422,
    "unavailable": 503,
}


class Keys(Protocol):
    """Where data subjects' keys are (`events/keys.py`): personal fields are sealed with them."""

    def seal(self, subject: str, data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        """`data` with `fields` sealed with `subject`'s key, made on first use; `gone` when the
        subject was erased."""
        ...

    def erase(self, subject: str) -> None:
        """Destroy `subject`'s key."""
        ...


@dataclass
class AggregateRecord:
    version: int
    state: Any

    def snapshot(self, aggregate_type: str, aggregate_id: str) -> dict[str, Any]:
        return {
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "version": self.version,
            "state": to_data(self.state),
        }

    @classmethod
    def from_snapshot(cls, doc: dict[str, Any]) -> AggregateRecord:
        state_type = AGGREGATES[doc["aggregate_type"]].state_type
        return cls(doc["version"], from_data(state_type, doc["state"]))


# How long an Idempotency-Key is remembered: the idempotency topic's retention.
IDEMPOTENCY_RETENTION_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class IdempotencyRecord:
    fingerprint: str
    status: int
    body: dict[str, Any]
    at: float  # when it was recorded (seconds since the epoch)


@dataclass
class PartitionState:
    aggregates: dict[tuple[str, str], AggregateRecord] = field(default_factory=dict)
    # In the order recorded (oldest first), so expiry only ever looks at the front.
    idempotency: dict[str, IdempotencyRecord] = field(default_factory=dict)
    idempotency_retention_s: float = IDEMPOTENCY_RETENTION_S

    def remember(self, key: str, record: IdempotencyRecord, now: float) -> None:
        """Keep `record` unless it is already past the retention (a restore of old records)."""
        if record.at >= now - self.idempotency_retention_s:
            self.idempotency[key] = record

    def forget_expired(self, now: float) -> None:
        """Drop the keys older than the retention, as the topic does: memory stays bounded by
        what a retention's worth of keys weighs, and a processor that restarts (restoring only
        what the topic still holds, minus what is past the retention) knows the same keys."""
        cutoff = now - self.idempotency_retention_s
        while self.idempotency:
            key, oldest = next(iter(self.idempotency.items()))
            if oldest.at >= cutoff:
                return
            del self.idempotency[key]


@dataclass
class Outcome:
    status: int
    body: dict[str, Any]
    events: list[Envelope] = field(default_factory=list)
    replay: bool = False


def handle(
    msg: CommandMessage,
    part: PartitionState,
    refs: References,
    now: Callable[[], float],
    new_id: Callable[[], str],
    keys: Keys,
) -> Outcome:
    if now() > msg.deadline:
        return Outcome(504, error_body("timeout", "the command expired before it was processed"))
    if msg.idempotency_key is not None:
        part.forget_expired(now())
        seen = part.idempotency.get(msg.idempotency_key)
        if seen is not None:
            if seen.fingerprint != msg.fingerprint:
                return Outcome(
                    422,
                    error_body(
                        "idempotency_key_reused",
                        "this Idempotency-Key was used for a different request",
                    ),
                )
            return Outcome(seen.status, seen.body, replay=True)
    try:
        outcome = _decide(msg, part, refs, now, new_id, keys)
    except Rejected as r:
        return Outcome(STATUS[r.code], error_body(r.code, r.message, r.details))
    if msg.idempotency_key is not None and outcome.events:
        # Recorded at decision time: a retry queued behind its original in the same batch must
        # replay it, not be decided again. The processor adds the position to this same body
        # before any reply of the batch is sent.
        part.idempotency[msg.idempotency_key] = IdempotencyRecord(
            msg.fingerprint or "", outcome.status, outcome.body, now()
        )
    return outcome


def _decide(
    msg: CommandMessage,
    part: PartitionState,
    refs: References,
    now: Callable[[], float],
    new_id: Callable[[], str],
    keys: Keys,
) -> Outcome:
    spec = COMMANDS.get(msg.name)
    if spec is None or spec.aggregate.name != msg.aggregate_type:
        return Outcome(404, error_body("not_found", f"unknown command {msg.name!r}"))
    # Validated again, although the API did: the commands topic is a boundary too, and a
    # processor must not turn a record it did not check into events. It costs 2 µs for
    # `rename-customer`, 40 µs with an email address (docs/benchmarks-journal.md).
    try:
        command = spec.build(spec.schema.model_validate(msg.data).model_dump())
    except ValidationError as e:
        return Outcome(
            422, error_body("validation_failed", "the command is invalid", details(e, ("data",)))
        )
    key = (msg.aggregate_type, msg.aggregate_id)
    current = part.aggregates.get(key)
    version = current.version if current else 0
    if msg.expected_version is not None and msg.expected_version != version:
        raise version_conflict(msg.expected_version, version)
    if current is None and not spec.creates:
        return Outcome(
            404, error_body("not_found", f"{msg.aggregate_type} {msg.aggregate_id} does not exist")
        )
    state = current.state if current else None
    events = spec.aggregate.decide(state, command, refs)
    occurred_at = datetime.fromtimestamp(now(), UTC).isoformat().replace("+00:00", "Z")
    envelopes = []
    subject = f"{msg.aggregate_type}:{msg.aggregate_id}"  # whose personal fields these are
    for event in events:
        version += 1
        state = spec.aggregate.evolve(state, event)
        envelope = envelope_for(
            event,
            event_id=new_id(),
            aggregate_type=msg.aggregate_type,
            aggregate_id=msg.aggregate_id,
            version=version,
            occurred_at=occurred_at,
            command_id=msg.command_id,
            correlation_id=msg.correlation_id,
            causation_id=msg.command_id,
        )
        if event.PERSONAL:  # stored sealed (guarantee 27)
            envelope = replace(envelope, data=keys.seal(subject, envelope.data, event.PERSONAL))
        envelopes.append(envelope)
    for event in events:
        if event.ERASES:  # before the events are written: never a commit without it
            keys.erase(subject)
    part.aggregates[key] = AggregateRecord(version, state)
    body = {
        "aggregate_type": msg.aggregate_type,
        "aggregate_id": msg.aggregate_id,
        "version": version,
        "events": [
            {"event_id": e.event_id, "type": e.type, "version": e.version} for e in envelopes
        ],
    }
    return Outcome(201, body, envelopes)
