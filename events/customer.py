from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from events.base import DomainEvent


@dataclass(frozen=True)
class CustomerRegistered(DomainEvent):
    SCHEMA_VERSION: ClassVar[int] = 2  # v1 called `name` `full_name`
    name: str
    email: str


@dataclass(frozen=True)
class CustomerRenamed(DomainEvent):
    name: str


@dataclass(frozen=True)
class CustomerEmailChanged(DomainEvent):
    email: str
