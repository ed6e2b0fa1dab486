import pytest

from commands.customer import (
    ChangeCustomerEmail,
    Customer,
    EraseCustomer,
    RegisterCustomer,
    RenameCustomer,
)
from commands.registry import AGGREGATES
from events.customer import (
    CustomerEmailChanged,
    CustomerErased,
    CustomerRegistered,
    CustomerRenamed,
)

CUSTOMER = AGGREGATES["customer"]

REGISTERED = CustomerRegistered(name="Ann Lee", email="ann@example.com")


def test_register_a_new_customer(given):
    given(CUSTOMER).when(RegisterCustomer("Ann Lee", "ann@example.com")).then(REGISTERED)


def test_register_twice_is_a_rule_violation(given):
    given(CUSTOMER, REGISTERED).when(
        RegisterCustomer("Someone Else", "else@example.com")
    ).then_rejected("rule_violated", message_contains="already registered", details=[])


def test_rename(given):
    given(CUSTOMER, REGISTERED).when(RenameCustomer("Ann Park")).then(
        CustomerRenamed(name="Ann Park")
    )


def test_change_email(given):
    given(CUSTOMER, REGISTERED).when(ChangeCustomerEmail("ann@park.example")).then(
        CustomerEmailChanged(email="ann@park.example")
    )


def test_evolve_folds_every_event(given):
    state = given(
        CUSTOMER,
        REGISTERED,
        CustomerRenamed(name="Ann Park"),
        CustomerEmailChanged(email="ann@park.example"),
    ).state
    assert state == Customer()  # what deciding needs: it exists, not erased


def test_erase(given):
    given(CUSTOMER, REGISTERED).when(EraseCustomer()).then(CustomerErased())
    assert given(CUSTOMER, REGISTERED, CustomerErased()).state == Customer(erased=True)


@pytest.mark.parametrize(
    "command",
    [
        RenameCustomer("Ann Park"),
        ChangeCustomerEmail("a@b.example"),
        EraseCustomer(),
        RegisterCustomer("Ann Lee", "ann@example.com"),
    ],
)
def test_every_command_on_an_erased_customer_is_gone(given, command):
    given(CUSTOMER, REGISTERED, CustomerErased()).when(command).then_rejected(
        "gone", message_contains="erased", details=[]
    )


def test_register_is_still_refused_after_later_changes(given):
    given(CUSTOMER, REGISTERED, CustomerRenamed(name="Ann Park")).when(
        RegisterCustomer("Ann Lee", "ann@example.com")
    ).then_rejected("rule_violated")
