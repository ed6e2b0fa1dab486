"""Dataclass events <-> JSON-ready dicts, and the envelope <-> bytes on the wire.

Every record the write side stores or sends is JSON encoded once, by orjson (dataclasses
directly, no intermediate dict): the standard library's encoder was a tenth of a processor's
CPU per command (docs/benchmarks-journal.md)."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from events.base import DomainEvent
from events.catalog import EVENT_TYPES
from events.upcasting import upcast

T = TypeVar("T")


def to_data(obj: Any) -> Any:
    """A dataclass (nested dataclasses and tuples included) as plain JSON-ready values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


def from_data(cls: type[T], data: Any) -> T:
    """The inverse of `to_data`, driven by the dataclass's type hints."""
    return typing.cast(T, _build(cls, data))


def dumps(obj: Any) -> bytes:
    """Compact JSON (UTF-8) of JSON values, dataclasses included."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # an integer beyond 64 bits (say, a client's expected_version of 10**30)
        return json.dumps(obj, default=dataclasses.asdict, separators=(",", ":")).encode()


def loads(raw: bytes | str) -> Any:
    """Parse JSON; integers beyond 64 bits come back as floats."""
    return orjson.loads(raw)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved type) of a dataclass's init fields: resolving them is slow."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _build(tp: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp(**{name: _build(t, value[name]) for name, t in _fields(tp) if name in value})
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        return tuple(_build(args[0], v) for v in value)
    if origin is list:
        return [_build(args[0], v) for v in value]
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        return _build(next(a for a in args if a is not type(None)), value)
    if tp is float and isinstance(value, int):
        return float(value)
    return value


@dataclass(frozen=True)
class Envelope:
    """One event as stored: the metadata from docs/api.md around the event's `data`."""

    event_id: str
    type: str
    schema_version: int
    aggregate_type: str
    aggregate_id: str
    version: int
    occurred_at: str
    command_id: str
    correlation_id: str
    causation_id: str
    data: dict[str, Any]

    def event(self) -> DomainEvent:
        return from_data(EVENT_TYPES[self.type], self.data)


def envelope_for(event: DomainEvent, **meta: Any) -> Envelope:
    return Envelope(
        type=event.type_name(),
        schema_version=event.SCHEMA_VERSION,
        data=to_data(event),
        **meta,
    )


def encode(envelope: Envelope) -> bytes:
    return orjson.dumps(envelope)


def decode(raw: bytes | str) -> Envelope:
    """Parse a stored event and upcast its `data` to the current schema version."""
    doc = orjson.loads(raw)
    cls = EVENT_TYPES[doc["type"]]
    doc["data"] = upcast(doc["type"], doc["schema_version"], doc["data"], cls.SCHEMA_VERSION)
    doc["schema_version"] = cls.SCHEMA_VERSION
    return Envelope(**doc)
