from __future__ import annotations

from dataclasses import dataclass

from events.base import DomainEvent


@dataclass(frozen=True)
class BookAdded(DomainEvent):
    title: str
    author: str
    price_cents: int
    royalty_rate: float


@dataclass(frozen=True)
class BookRepriced(DomainEvent):
    price_cents: int
