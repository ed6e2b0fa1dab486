from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Literal

from commands.book import Book
from commands.customer import Customer
from commands.errors import invalid, rule_violated
from commands.fields import Amount, Command, Id, Items, Number, Text
from commands.references import References
from events.base import DomainEvent
from events.order import OrderCancelled, OrderPaid, OrderPlaced, OrderShipped, PlacedLine

Status = Literal["placed", "paid", "shipped", "cancelled"]


@dataclass(frozen=True)
class OrderLine:
    book_id: Id
    quantity: Annotated[int, Number(ge=1, le=1000)]


@dataclass(frozen=True)
class PlaceOrder(Command):
    """Place an order; prices, authors and royalty rates are frozen in the event"""

    creates = True
    customer_id: Id
    lines: Annotated[tuple[OrderLine, ...], Items(min_length=1, max_length=50)]


@dataclass(frozen=True)
class PayOrder(Command):
    """Pay a placed order (the amount must equal its total)"""

    amount_cents: Amount


@dataclass(frozen=True)
class ShipOrder(Command):
    """Ship a paid order"""


@dataclass(frozen=True)
class CancelOrder(Command):
    """Cancel an order that has not shipped"""

    reason: Annotated[str, Text(max_length=500, pattern=r"^[^\x00]*$")]


COMMANDS = (PlaceOrder, PayOrder, ShipOrder, CancelOrder)


@dataclass(frozen=True)
class Order:
    customer_id: str
    total_cents: int
    status: Status
    lines: tuple[PlacedLine, ...] = ()


def decide(state: Order | None, command: object, refs: References) -> list[DomainEvent]:
    match command:
        case PlaceOrder(customer_id, lines):
            if state is not None:
                raise rule_violated("order already exists")
            return [_place(customer_id, lines, refs)]
        case PayOrder(amount_cents):
            assert state is not None
            if state.status != "placed":
                raise rule_violated(f"only a placed order can be paid; this one is {state.status}")
            if amount_cents != state.total_cents:
                raise rule_violated(
                    f"amount {amount_cents} does not match the order total {state.total_cents}"
                )
            return [OrderPaid(amount_cents=amount_cents, lines=state.lines)]
        case ShipOrder():
            assert state is not None
            if state.status != "paid":
                raise rule_violated(f"only a paid order can be shipped; this one is {state.status}")
            return [OrderShipped()]
        case CancelOrder(reason):
            assert state is not None
            if state.status in ("shipped", "cancelled"):
                raise rule_violated(f"a {state.status} order cannot be cancelled")
            return [OrderCancelled(reason=reason)]
    raise TypeError(f"order cannot handle {command!r}")


def _place(customer_id: str, lines: tuple[OrderLine, ...], refs: References) -> OrderPlaced:
    problems = []
    customer = refs.get("customer", customer_id)
    if customer is None:
        problems.append({"field": "data.customer_id", "problem": f"unknown customer {customer_id}"})
    elif isinstance(customer, Customer) and customer.erased:
        problems.append(
            {"field": "data.customer_id", "problem": f"customer {customer_id} was erased"}
        )
    placed = []
    for i, line in enumerate(lines):
        book = refs.get("book", line.book_id)
        if not isinstance(book, Book):
            problems.append({"field": f"data.lines.{i}.book_id", "problem": "unknown book"})
            continue
        placed.append(
            PlacedLine(
                line.book_id, line.quantity, book.price_cents, book.author, book.royalty_rate
            )
        )
    if problems:
        raise invalid("the order refers to unknown customers or books", problems)
    total = sum(p.quantity * p.unit_price_cents for p in placed)
    return OrderPlaced(customer_id=customer_id, lines=tuple(placed), total_cents=total)


def evolve(state: Order | None, event: DomainEvent) -> Order:
    match event:
        case OrderPlaced(customer_id, lines, total_cents):
            return Order(customer_id, total_cents, "placed", lines)
        case OrderPaid():
            assert state is not None
            return replace(state, status="paid")
        case OrderShipped():
            assert state is not None
            return replace(state, status="shipped")
        case OrderCancelled():
            assert state is not None
            return replace(state, status="cancelled")
    raise TypeError(f"order cannot apply {event!r}")
