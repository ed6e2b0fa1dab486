from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

from commands.errors import rule_violated
from commands.fields import ONE_LINE, Cents, Command, Name, Number, Text
from commands.references import References
from events.base import DomainEvent
from events.book import BookAdded, BookRepriced


@dataclass(frozen=True)
class AddBook(Command):
    """Add a book to the catalogue"""

    creates = True
    title: Annotated[str, Text(max_length=300, pattern=ONE_LINE)]
    author: Name
    price_cents: Cents
    royalty_rate: Annotated[float, Number(ge=0, le=0.5)]


@dataclass(frozen=True)
class RepriceBook(Command):
    """Change a book's price"""

    price_cents: Cents


COMMANDS = (AddBook, RepriceBook)


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
