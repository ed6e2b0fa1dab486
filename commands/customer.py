from __future__ import annotations

from dataclasses import dataclass, replace

from commands.errors import gone, rule_violated
from commands.fields import Command, EmailAddress, Name
from commands.references import References
from events.base import DomainEvent
from events.customer import (
    CustomerEmailChanged,
    CustomerErased,
    CustomerRegistered,
    CustomerRenamed,
)


@dataclass(frozen=True)
class RegisterCustomer(Command):
    """Register a new customer"""

    creates = True
    name: Name
    email: EmailAddress


@dataclass(frozen=True)
class RenameCustomer(Command):
    """Rename a customer"""

    name: Name


@dataclass(frozen=True)
class ChangeCustomerEmail(Command):
    """Change a customer's email"""

    email: EmailAddress


@dataclass(frozen=True)
class EraseCustomer(Command):
    """Erase a customer's personal fields everywhere (crypto-shredding)"""

    scope = "admin"


COMMANDS = (RegisterCustomer, RenameCustomer, ChangeCustomerEmail, EraseCustomer)


@dataclass(frozen=True)
class Customer:
    """What deciding needs: that it exists, and whether it was erased. Its name and email are
    not kept (no decision reads them, and the state is stored in clear: the snapshots)."""

    erased: bool = False


def decide(state: Customer | None, command: object, refs: References) -> list[DomainEvent]:
    if state is not None and state.erased:
        raise gone("the customer was erased")
    match command:
        case RegisterCustomer(name, email):
            if state is not None:
                raise rule_violated("customer is already registered")
            return [CustomerRegistered(name=name, email=email)]
        case RenameCustomer(name):
            return [CustomerRenamed(name=name)]
        case ChangeCustomerEmail(email):
            return [CustomerEmailChanged(email=email)]
        case EraseCustomer():
            return [CustomerErased()]
    raise TypeError(f"customer cannot handle {command!r}")


def evolve(state: Customer | None, event: DomainEvent) -> Customer:
    match event:
        case CustomerRegistered():
            return Customer()
        case CustomerRenamed() | CustomerEmailChanged():
            assert state is not None
            return state
        case CustomerErased():
            return replace(state or Customer(), erased=True)
    raise TypeError(f"customer cannot apply {event!r}")
