import math
from dataclasses import dataclass
from typing import Annotated

import pytest
from pydantic import BaseModel, ValidationError

from commands.book import AddBook, RepriceBook
from commands.customer import ChangeCustomerEmail, EraseCustomer, RegisterCustomer, RenameCustomer
from commands.fields import Command, Name, Number
from commands.order import CancelOrder, OrderLine, PayOrder, PlaceOrder, ShipOrder
from commands.registry import AGGREGATES, COMMANDS, CommandSpec
from commands.schemas import CommandRequest, details, payload_model

# Each command's payload model, as the API derives it from the command's dataclass.
RegisterCustomerData = payload_model(RegisterCustomer)
RenameCustomerData = payload_model(RenameCustomer)
ChangeCustomerEmailData = payload_model(ChangeCustomerEmail)
AddBookData = payload_model(AddBook)
RepriceBookData = payload_model(RepriceBook)
PlaceOrderData = payload_model(PlaceOrder)
PayOrderData = payload_model(PayOrder)
ShipOrderData = payload_model(ShipOrder)

BOOK = {"title": "Dune", "author": "Frank Herbert", "price_cents": 1999, "royalty_rate": 0.1}
LINE = {"book_id": "b-1", "quantity": 1}


def errors(model: type[BaseModel], data: dict) -> list[tuple[tuple, str]]:
    """(location, error type) of every problem pydantic finds; [] when `data` is valid."""
    try:
        model.model_validate(data)
    except ValidationError as e:
        return [(e_["loc"], e_["type"]) for e_ in e.errors()]
    return []


def order(*lines: dict, **overrides) -> dict:
    return {"customer_id": "c-1", "lines": list(lines), **overrides}


# names: 1-200 characters


@pytest.mark.parametrize(
    ("model", "data", "field"),
    [
        (RegisterCustomerData, {"email": "ann@example.com"}, "name"),
        (RenameCustomerData, {}, "name"),
        (AddBookData, {k: v for k, v in BOOK.items() if k != "author"}, "author"),
    ],
)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("A", None),
        ("x" * 200, None),
        ("", "string_too_short"),
        ("x" * 201, "string_too_long"),
        (None, "string_type"),
    ],
)
def test_name_is_1_to_200_characters(model, data, field, value, expected):
    found = errors(model, {**data, field: value})
    assert found == ([] if expected is None else [((field,), expected)])


def test_missing_name_is_reported():
    assert errors(RenameCustomerData, {}) == [(("name",), "missing")]


# email


@pytest.mark.parametrize("model", [RegisterCustomerData, ChangeCustomerEmailData])
@pytest.mark.parametrize("email", ["not-an-email", "ann@", "@example.com", "ann@@example.com", ""])
def test_email_must_be_a_valid_address(model, email):
    data = {"email": email} | ({"name": "Ann"} if model is RegisterCustomerData else {})
    assert errors(model, data) == [(("email",), "value_error")]


@pytest.mark.parametrize("model", [RegisterCustomerData, ChangeCustomerEmailData])
def test_a_valid_email_is_accepted(model):
    data = {"email": "ann.lee+books@example.co.uk"}
    data |= {"name": "Ann"} if model is RegisterCustomerData else {}
    assert errors(model, data) == []


# cents: > 0, and integers only


@pytest.mark.parametrize(
    ("model", "base", "field"),
    [
        (AddBookData, BOOK, "price_cents"),
        (RepriceBookData, {}, "price_cents"),
        (PayOrderData, {}, "amount_cents"),
    ],
)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, None),
        (0, "greater_than"),
        (-5, "greater_than"),
        ("500", "int_type"),
        (5.0, "int_type"),
        (True, "int_type"),
    ],
)
def test_cents_are_positive_integers(model, base, field, value, expected):
    found = errors(model, {**base, field: value})
    assert found == ([] if expected is None else [((field,), expected)])


# royalty rate: 0-0.5


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (0, None),
        (0.0, None),
        (0.5, None),
        (0.25, None),
        (-0.01, "greater_than_equal"),
        (0.51, "less_than_equal"),
        (1, "less_than_equal"),
        (math.nan, "finite_number"),
        ("0.1", "float_type"),
    ],
)
def test_royalty_rate_is_between_0_and_half(rate, expected):
    found = errors(AddBookData, {**BOOK, "royalty_rate": rate})
    assert found == ([] if expected is None else [(("royalty_rate",), expected)])


# order lines: 1-50, quantity 1-1000


@pytest.mark.parametrize(
    ("count", "expected"), [(1, None), (50, None), (0, "too_short"), (51, "too_long")]
)
def test_an_order_has_1_to_50_lines(count, expected):
    found = errors(PlaceOrderData, order(*[LINE] * count))
    assert found == ([] if expected is None else [(("lines",), expected)])


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        (1, None),
        (1000, None),
        (0, "greater_than_equal"),
        (1001, "less_than_equal"),
        ("2", "int_type"),
        (1.5, "int_type"),
    ],
)
def test_quantity_is_1_to_1000(quantity, expected):
    found = errors(PlaceOrderData, order(LINE, {"book_id": "b-2", "quantity": quantity}))
    assert found == ([] if expected is None else [(("lines", 1, "quantity"), expected)])


@pytest.mark.parametrize("bad_id", ["", "has space", "slash/id", "x" * 65])
def test_ids_are_short_and_url_safe(bad_id):
    found = errors(PlaceOrderData, order({"book_id": bad_id, "quantity": 1}, customer_id=bad_id))
    assert [loc for loc, _ in found] == [("customer_id",), ("lines", 0, "book_id")]


def test_lines_must_be_objects_not_strings():
    assert errors(PlaceOrderData, order("b-1")) == [(("lines", 0), "model_type")]


# unknown fields are refused, at every level


@pytest.mark.parametrize(
    ("model", "data", "loc"),
    [
        (RegisterCustomerData, {"name": "Ann", "email": "ann@example.com", "vip": True}, ("vip",)),
        (RenameCustomerData, {"name": "Ann", "email": "ann@example.com"}, ("email",)),
        (ChangeCustomerEmailData, {"email": "ann@example.com", "name": "Ann"}, ("name",)),
        (AddBookData, {**BOOK, "isbn": "123"}, ("isbn",)),
        (RepriceBookData, {"price_cents": 1, "currency": "EUR"}, ("currency",)),
        (PlaceOrderData, order(LINE, note="hi"), ("note",)),
        (PlaceOrderData, order({**LINE, "price_cents": 1}), ("lines", 0, "price_cents")),
        (PayOrderData, {"amount_cents": 1, "tip": 1}, ("tip",)),
        (ShipOrderData, {"carrier": "ups"}, ("carrier",)),
    ],
)
def test_extra_fields_are_refused(model, data, loc):
    assert errors(model, data) == [(loc, "extra_forbidden")]


def test_every_problem_is_reported_at_once():
    found = errors(
        PlaceOrderData,
        {"lines": [{"book_id": "b-1", "quantity": 0}, {"quantity": "3"}], "x": 1},
    )
    assert sorted(found) == sorted(
        [
            (("customer_id",), "missing"),
            (("lines", 0, "quantity"), "greater_than_equal"),
            (("lines", 1, "book_id"), "missing"),
            (("lines", 1, "quantity"), "int_type"),
            (("x",), "extra_forbidden"),
        ]
    )


# the request envelope


def test_command_request_defaults():
    request = CommandRequest.model_validate({})
    assert (request.aggregate_id, request.expected_version, request.data) == (None, None, {})


@pytest.mark.parametrize(
    ("body", "loc", "kind"),
    [
        ({"expected_version": -1}, ("expected_version",), "greater_than_equal"),
        ({"expected_version": "3"}, ("expected_version",), "int_type"),
        ({"aggregate_id": "a b"}, ("aggregate_id",), "string_pattern_mismatch"),
        ({"data": {}, "version": 1}, ("version",), "extra_forbidden"),
    ],
)
def test_command_request_is_checked(body, loc, kind):
    assert errors(CommandRequest, body) == [(loc, kind)]


# the registry turns every validated payload into its domain command

SAMPLES = {
    "register-customer": (
        {"name": "Ann Lee", "email": "ann@example.com"},
        RegisterCustomer("Ann Lee", "ann@example.com"),
    ),
    "rename-customer": ({"name": "Ann Park"}, RenameCustomer("Ann Park")),
    "erase-customer": ({}, EraseCustomer()),
    "change-customer-email": (
        {"email": "ann@park.example"},
        ChangeCustomerEmail("ann@park.example"),
    ),
    "add-book": (BOOK, AddBook("Dune", "Frank Herbert", 1999, 0.1)),
    "reprice-book": ({"price_cents": 2499}, RepriceBook(2499)),
    "place-order": (
        order(LINE, {"book_id": "b-2", "quantity": 7}),
        PlaceOrder("c-1", (OrderLine("b-1", 1), OrderLine("b-2", 7))),
    ),
    "pay-order": ({"amount_cents": 6995}, PayOrder(6995)),
    "ship-order": ({}, ShipOrder()),
    "cancel-order": ({"reason": "changed my mind"}, CancelOrder("changed my mind")),
}


def test_every_command_has_a_sample():
    assert set(SAMPLES) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_build_produces_the_domain_command(name):
    spec = COMMANDS[name]
    payload, expected = SAMPLES[name]
    command = spec.build(spec.schema.model_validate(payload).model_dump(mode="json"))
    assert type(command) is spec.command_type
    assert command == expected


def test_build_gives_hashable_tuples_for_order_lines():
    spec = COMMANDS["place-order"]
    command = spec.build(spec.schema.model_validate(order(LINE)).model_dump(mode="json"))
    assert isinstance(command.lines, tuple)
    assert hash(command) == hash(PlaceOrder("c-1", (OrderLine("b-1", 1),)))


def test_build_turns_an_integer_royalty_rate_into_a_float():
    spec = COMMANDS["add-book"]
    command = spec.build(
        spec.schema.model_validate({**BOOK, "royalty_rate": 0}).model_dump(mode="json")
    )
    assert isinstance(command.royalty_rate, float)


# each command is defined once: its dataclass; everything else derives from it


@dataclass(frozen=True)
class GiftBook(Command):
    """Give copies of a book away"""

    recipient: Name
    copies: Annotated[int, Number(ge=1, le=3)]


def test_a_new_command_needs_only_its_dataclass():
    spec = CommandSpec(AGGREGATES["book"], GiftBook)
    assert (spec.name, spec.summary, spec.creates) == (
        "gift-book",
        "Give copies of a book away",
        False,
    )
    assert spec.schema.__name__ == "GiftBookData"
    assert errors(spec.schema, {"recipient": "", "copies": 4, "extra": 1}) == [
        (("recipient",), "string_too_short"),
        (("copies",), "less_than_equal"),
        (("extra",), "extra_forbidden"),
    ]
    valid = spec.schema.model_validate({"recipient": "Ann", "copies": 2})
    assert spec.build(valid.model_dump()) == GiftBook("Ann", 2)


def test_validation_errors_become_the_contracts_details():
    try:
        payload_model(PlaceOrder).model_validate(order({"book_id": "b 1", "quantity": 0}))
    except ValidationError as e:
        found = details(e, prefix=("data",))
    assert [d["field"] for d in found] == ["data.lines.0.book_id", "data.lines.0.quantity"]
    assert all(d["problem"] for d in found)
