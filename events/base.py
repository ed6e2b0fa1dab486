"""What every domain event is: a frozen dataclass with a schema version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class DomainEvent:
    """Base of all event payloads. The class name is the event type; `SCHEMA_VERSION` is the
    version of its `data` shape, raised whenever the shape changes (with an upcaster for the old
    one in `events.upcasting`)."""

    SCHEMA_VERSION: ClassVar[int] = 1

    @classmethod
    def type_name(cls) -> str:
        return cls.__name__
