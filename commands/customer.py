from __future__ import annotations

from dataclasses import dataclass, replace

from commands.errors import rule_violated
from commands.fields import Command, EmailAddress, Name
from commands.references import References
from events.base import DomainEvent
from events.customer import CustomerEmailChanged, CustomerRegistered, CustomerRenamed


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


COMMANDS = (RegisterCustomer, RenameCustomer, ChangeCustomerEmail)


@dataclass(frozen=True)
class Customer:
    name: str
    email: str


def decide(state: Customer | None, command: object, refs: References) -> list[DomainEvent]:
    match command:
        case RegisterCustomer(name, email):
            if state is not None:
                raise rule_violated("customer is already registered")
            return [CustomerRegistered(name=name, email=email)]
        case RenameCustomer(name):
            return [CustomerRenamed(name=name)]
        case ChangeCustomerEmail(email):
            return [CustomerEmailChanged(email=email)]
    raise TypeError(f"customer cannot handle {command!r}")


def evolve(state: Customer | None, event: DomainEvent) -> Customer:
    match event:
        case CustomerRegistered(name, email):
            return Customer(name=name, email=email)
        case CustomerRenamed(name):
            assert state is not None
            return replace(state, name=name)
        case CustomerEmailChanged(email):
            assert state is not None
            return replace(state, email=email)
    raise TypeError(f"customer cannot apply {event!r}")
