"""Upcasters turn the stored `data` of an old schema version into the next version's shape.

Events are never rewritten: old records stay in Kafka as they were written and are upcast each
time they are read. Register one function per (event type, old version); a chain of them takes
any old version to the current one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Data = dict[str, Any]
Upcaster = Callable[[Data], Data]

UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register


class UnknownSchemaVersion(ValueError):
    pass


def upcast(event_type: str, version: int, data: Data, current: int) -> Data:
    """Return `data` (written at `version`) in the shape of version `current`."""
    if version > current:
        raise UnknownSchemaVersion(
            f"{event_type} v{version} is newer than this code (v{current}); upgrade Logfold"
        )
    while version < current:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise UnknownSchemaVersion(f"no upcaster for {event_type} v{version}")
        data = step(dict(data))
        version += 1
    return data


@upcaster("CustomerRegistered", 1)
def _customer_registered_v1(data: Data) -> Data:
    data["name"] = data.pop("full_name")
    return data
