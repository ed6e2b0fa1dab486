"""The one place that says which aggregates exist; each aggregate module lists its commands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel

from commands import book, customer, order
from commands.fields import Command
from commands.references import References
from commands.schemas import payload_model
from events.base import DomainEvent
from events.catalog import AGGREGATE_TYPES
from events.serialization import from_data

Decide = Callable[[Any, Any, References], list[DomainEvent]]
Evolve = Callable[[Any, DomainEvent], Any]


@dataclass(frozen=True)
class Aggregate:
    name: str
    state_type: type
    decide: Decide
    evolve: Evolve
    commands: tuple[type[Command], ...]


@dataclass(frozen=True)
class CommandSpec:
    """A command as the API and the processors see it, derived from its dataclass."""

    aggregate: Aggregate
    command_type: type[Command]

    @property
    def name(self) -> str:
        return self.command_type.wire_name()

    @property
    def creates(self) -> bool:
        return self.command_type.creates

    @property
    def summary(self) -> str:
        return self.command_type.summary()

    @property
    def schema(self) -> type[BaseModel]:
        """The pydantic model of its `data` (validation at the API, OpenAPI)."""
        return payload_model(cast(type, self.command_type))

    def build(self, data: dict[str, Any]) -> Command:
        """The command from `data` as its `schema` has validated it."""
        return from_data(self.command_type, data)


AGGREGATES: dict[str, Aggregate] = {
    a.name: a
    for a in (
        Aggregate(
            "customer", customer.Customer, customer.decide, customer.evolve, customer.COMMANDS
        ),
        Aggregate("book", book.Book, book.decide, book.evolve, book.COMMANDS),
        Aggregate("order", order.Order, order.decide, order.evolve, order.COMMANDS),
    )
}

# The event log's aggregates (events/catalog.py) and the write model's are one list, named twice
# so each side stays readable on its own: they must agree.
if set(AGGREGATES) != set(AGGREGATE_TYPES):
    raise ImportError(
        f"commands/registry.py has aggregates {sorted(AGGREGATES)} and events/catalog.py "
        f"{sorted(AGGREGATE_TYPES)}: each aggregate needs a line in both"
    )

COMMANDS: dict[str, CommandSpec] = {
    c.wire_name(): CommandSpec(a, c) for a in AGGREGATES.values() for c in a.commands
}
