"""Every event type, by name.

Adding an event = a dataclass in its aggregate's module + a line here."""

from __future__ import annotations

from events.base import DomainEvent
from events.book import BookAdded, BookRepriced
from events.customer import (
    CustomerEmailChanged,
    CustomerErased,
    CustomerRegistered,
    CustomerRenamed,
)
from events.order import OrderCancelled, OrderPaid, OrderPlaced, OrderShipped

EVENTS_BY_AGGREGATE: dict[str, tuple[type[DomainEvent], ...]] = {
    "customer": (CustomerRegistered, CustomerRenamed, CustomerEmailChanged, CustomerErased),
    "book": (BookAdded, BookRepriced),
    "order": (OrderPlaced, OrderPaid, OrderShipped, OrderCancelled),
}

EVENT_TYPES: dict[str, type[DomainEvent]] = {
    cls.type_name(): cls for classes in EVENTS_BY_AGGREGATE.values() for cls in classes
}

AGGREGATE_TYPES: tuple[str, ...] = tuple(EVENTS_BY_AGGREGATE)
