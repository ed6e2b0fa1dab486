from __future__ import annotations

from dataclasses import dataclass

from events.base import DomainEvent


@dataclass(frozen=True)
class PlacedLine:
    """A line as it was when the order was placed: price, author and royalty rate are frozen."""

    book_id: str
    quantity: int
    unit_price_cents: int
    author: str
    royalty_rate: float


@dataclass(frozen=True)
class OrderPlaced(DomainEvent):
    customer_id: str
    lines: tuple[PlacedLine, ...]
    total_cents: int


@dataclass(frozen=True)
class OrderPaid(DomainEvent):
    """Carries the paid lines (as placed) so read models fold a payment without looking back."""

    amount_cents: int
    lines: tuple[PlacedLine, ...]


@dataclass(frozen=True)
class OrderShipped(DomainEvent):
    pass


@dataclass(frozen=True)
class OrderCancelled(DomainEvent):
    reason: str
