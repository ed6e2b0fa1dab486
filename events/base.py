"""What every domain event is: a frozen dataclass with a schema version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# What a view shows of a personal field whose subject was erased (guarantee 27).
ERASED = "[erased]"


@dataclass(frozen=True)
class DomainEvent:
    """Base of all event payloads. The class name is the event type; `SCHEMA_VERSION` is the
    version of its `data` shape, raised whenever the shape changes (with an upcaster for the old
    one in `events.upcasting`)."""

    SCHEMA_VERSION: ClassVar[int] = 1
    # Its personal fields (guarantee 27): stored sealed with a key of its aggregate's own (the
    # data subject), readable while that key exists (`events/keys.py`). A projection may copy
    # them into a view, never compute on them: they are opened only as rows enter Postgres.
    PERSONAL: ClassVar[tuple[str, ...]] = ()
    # Whether it erases its aggregate: the subject's key is destroyed as it is written.
    ERASES: ClassVar[bool] = False

    @classmethod
    def type_name(cls) -> str:
        return cls.__name__
