"""The one place that says which commands exist, which aggregate handles each, and how."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from commands import book, customer, order, schemas
from commands.references import References
from events.base import DomainEvent
from events.serialization import from_data

Decide = Callable[[Any, Any, References], list[DomainEvent]]
Evolve = Callable[[Any, DomainEvent], Any]


@dataclass(frozen=True)
class Aggregate:
    name: str
    state_type: type
    decide: Decide
    evolve: Evolve


@dataclass(frozen=True)
class CommandSpec:
    name: str
    aggregate: Aggregate
    command_type: type
    schema: type[BaseModel]
    creates: bool
    summary: str

    def build(self, data: BaseModel) -> object:
        return from_data(self.command_type, data.model_dump())


CUSTOMER = Aggregate("customer", customer.Customer, customer.decide, customer.evolve)
BOOK = Aggregate("book", book.Book, book.decide, book.evolve)
ORDER = Aggregate("order", order.Order, order.decide, order.evolve)

AGGREGATES: dict[str, Aggregate] = {a.name: a for a in (CUSTOMER, BOOK, ORDER)}

COMMANDS: dict[str, CommandSpec] = {
    spec.name: spec
    for spec in (
        CommandSpec(
            "register-customer",
            CUSTOMER,
            customer.RegisterCustomer,
            schemas.RegisterCustomerData,
            True,
            "Register a new customer",
        ),
        CommandSpec(
            "rename-customer",
            CUSTOMER,
            customer.RenameCustomer,
            schemas.RenameCustomerData,
            False,
            "Rename a customer",
        ),
        CommandSpec(
            "change-customer-email",
            CUSTOMER,
            customer.ChangeCustomerEmail,
            schemas.ChangeCustomerEmailData,
            False,
            "Change a customer's email",
        ),
        CommandSpec(
            "add-book", BOOK, book.AddBook, schemas.AddBookData, True, "Add a book to the catalogue"
        ),
        CommandSpec(
            "reprice-book",
            BOOK,
            book.RepriceBook,
            schemas.RepriceBookData,
            False,
            "Change a book's price",
        ),
        CommandSpec(
            "place-order",
            ORDER,
            order.PlaceOrder,
            schemas.PlaceOrderData,
            True,
            "Place an order; prices, authors and royalty rates are frozen in the event",
        ),
        CommandSpec(
            "pay-order",
            ORDER,
            order.PayOrder,
            schemas.PayOrderData,
            False,
            "Pay a placed order (the amount must equal its total)",
        ),
        CommandSpec(
            "ship-order", ORDER, order.ShipOrder, schemas.ShipOrderData, False, "Ship a paid order"
        ),
        CommandSpec(
            "cancel-order",
            ORDER,
            order.CancelOrder,
            schemas.CancelOrderData,
            False,
            "Cancel an order that has not shipped",
        ),
    )
}
