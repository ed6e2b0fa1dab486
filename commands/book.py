from __future__ import annotations

from dataclasses import dataclass, replace

from commands.errors import rule_violated
from commands.references import References
from events.base import DomainEvent
from events.book import BookAdded, BookRepriced


@dataclass(frozen=True)
class AddBook:
    title: str
    author: str
    price_cents: int
    royalty_rate: float


@dataclass(frozen=True)
class RepriceBook:
    price_cents: int


@dataclass(frozen=True)
class Book:
    title: str
    author: str
    price_cents: int
    royalty_rate: float


def decide(state: Book | None, command: object, refs: References) -> list[DomainEvent]:
    match command:
        case AddBook(title, author, price_cents, royalty_rate):
            if state is not None:
                raise rule_violated("book already exists")
            return [BookAdded(title, author, price_cents, royalty_rate)]
        case RepriceBook(price_cents):
            return [BookRepriced(price_cents=price_cents)]
    raise TypeError(f"book cannot handle {command!r}")


def evolve(state: Book | None, event: DomainEvent) -> Book:
    match event:
        case BookAdded(title, author, price_cents, royalty_rate):
            return Book(title, author, price_cents, royalty_rate)
        case BookRepriced(price_cents):
            assert state is not None
            return replace(state, price_cents=price_cents)
    raise TypeError(f"book cannot apply {event!r}")
