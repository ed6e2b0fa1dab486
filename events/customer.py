from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from events.base import DomainEvent


@dataclass(frozen=True)
class CustomerRegistered(DomainEvent):
    SCHEMA_VERSION: ClassVar[int] = 2  # v1 called `name` `full_name`
    PERSONAL: ClassVar[tuple[str, ...]] = ("name", "email")
    name: str
    email: str


@dataclass(frozen=True)
class CustomerRenamed(DomainEvent):
    PERSONAL: ClassVar[tuple[str, ...]] = ("name",)
    name: str


@dataclass(frozen=True)
class CustomerEmailChanged(DomainEvent):
    PERSONAL: ClassVar[tuple[str, ...]] = ("email",)
    email: str


@dataclass(frozen=True)
class CustomerErased(DomainEvent):
    """The customer's personal fields are erased: its key is destroyed, its earlier events'
    personal fields can no longer be read, and its views show them erased."""

    ERASES: ClassVar[bool] = True
