import pytest

from commands.book import Book
from commands.customer import Customer
from commands.order import CancelOrder, Order, OrderLine, PayOrder, PlaceOrder, ShipOrder
from commands.registry import AGGREGATES
from events.order import OrderCancelled, OrderPaid, OrderPlaced, OrderShipped, PlacedLine

ORDER = AGGREGATES["order"]

DUNE = Book(title="Dune", author="Frank Herbert", price_cents=1999, royalty_rate=0.1)
EMMA = Book(title="Emma", author="Jane Austen", price_cents=999, royalty_rate=0.25)

PLACED = OrderPlaced(
    customer_id="c-1",
    lines=(
        PlacedLine("b-dune", 2, 1999, "Frank Herbert", 0.1),
        PlacedLine("b-emma", 3, 999, "Jane Austen", 0.25),
    ),
    total_cents=6995,
)
PAID = OrderPaid(amount_cents=6995, lines=PLACED.lines)
SHIPPED = OrderShipped()
CANCELLED = OrderCancelled(reason="changed my mind")

HISTORIES = {
    "placed": (PLACED,),
    "paid": (PLACED, PAID),
    "shipped": (PLACED, PAID, SHIPPED),
    "cancelled": (PLACED, CANCELLED),
    "cancelled-after-payment": (PLACED, PAID, CANCELLED),
}


@pytest.fixture
def shop(refs):
    return (
        refs.with_("customer", "c-1", Customer())
        .with_("book", "b-dune", DUNE)
        .with_("book", "b-emma", EMMA)
    )


def place(customer_id="c-1", *lines):
    return PlaceOrder(customer_id, tuple(OrderLine(b, q) for b, q in lines))


# place-order


def test_place_freezes_price_author_and_royalty_of_each_line(given, shop):
    given(ORDER, refs=shop).when(place("c-1", ("b-dune", 2), ("b-emma", 3))).then(PLACED)


def test_place_uses_the_books_current_state(given, shop):
    shop.with_("book", "b-dune", Book("Dune", "F. Herbert", 2500, 0.15))
    given(ORDER, refs=shop).when(place("c-1", ("b-dune", 4))).then(
        OrderPlaced(
            customer_id="c-1",
            lines=(PlacedLine("b-dune", 4, 2500, "F. Herbert", 0.15),),
            total_cents=10000,
        )
    )


def test_place_the_same_book_on_two_lines_sums_both(given, shop):
    events = given(ORDER, refs=shop).when(place("c-1", ("b-emma", 1), ("b-emma", 1000))).events
    assert events is not None
    assert events[0].total_cents == 1001 * 999


def test_place_on_an_existing_order_is_a_rule_violation(given, shop):
    given(ORDER, PLACED, refs=shop).when(place("c-1", ("b-dune", 1))).then_rejected(
        "rule_violated", message_contains="already exists"
    )


def test_place_for_an_unknown_customer_is_invalid(given, shop):
    given(ORDER, refs=shop).when(place("c-404", ("b-dune", 1))).then_rejected(
        "validation_failed",
        details=[{"field": "data.customer_id", "problem": "unknown customer c-404"}],
    )


def test_place_with_an_unknown_book_names_the_line(given, shop):
    given(ORDER, refs=shop).when(
        place("c-1", ("b-dune", 1), ("b-404", 1), ("b-emma", 1))
    ).then_rejected(
        "validation_failed",
        details=[{"field": "data.lines.1.book_id", "problem": "unknown book"}],
    )


def test_place_lists_every_bad_field(given, shop):
    given(ORDER, refs=shop).when(place("c-404", ("b-404", 1), ("b-405", 2))).then_rejected(
        "validation_failed",
        details=[
            {"field": "data.customer_id", "problem": "unknown customer c-404"},
            {"field": "data.lines.0.book_id", "problem": "unknown book"},
            {"field": "data.lines.1.book_id", "problem": "unknown book"},
        ],
    )


def test_place_with_no_references_at_all_is_invalid(given):
    error = given(ORDER).when(place("c-1", ("b-dune", 1))).then_rejected("validation_failed")
    assert [d["field"] for d in error.details] == ["data.customer_id", "data.lines.0.book_id"]


# pay-order


def test_pay_the_exact_total(given):
    given(ORDER, PLACED).when(PayOrder(6995)).then(OrderPaid(amount_cents=6995, lines=PLACED.lines))


@pytest.mark.parametrize("amount", [6994, 6996, 1999])
def test_pay_a_wrong_amount_is_a_rule_violation(given, amount):
    given(ORDER, PLACED).when(PayOrder(amount)).then_rejected(
        "rule_violated", message_contains="6995"
    )


@pytest.mark.parametrize("status", ["paid", "shipped", "cancelled", "cancelled-after-payment"])
def test_pay_when_not_placed_is_a_rule_violation(given, status):
    given(ORDER, *HISTORIES[status]).when(PayOrder(6995)).then_rejected(
        "rule_violated", message_contains="only a placed order can be paid"
    )


# ship-order


def test_ship_a_paid_order(given):
    given(ORDER, PLACED, PAID).when(ShipOrder()).then(OrderShipped())


@pytest.mark.parametrize("status", ["placed", "shipped", "cancelled", "cancelled-after-payment"])
def test_ship_when_not_paid_is_a_rule_violation(given, status):
    given(ORDER, *HISTORIES[status]).when(ShipOrder()).then_rejected(
        "rule_violated", message_contains="only a paid order can be shipped"
    )


# cancel-order


@pytest.mark.parametrize("status", ["placed", "paid"])
def test_cancel_before_shipping(given, status):
    given(ORDER, *HISTORIES[status]).when(CancelOrder("out of stock")).then(
        OrderCancelled(reason="out of stock")
    )


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ("shipped", "a shipped order cannot be cancelled"),
        ("cancelled", "a cancelled order cannot be cancelled"),
        ("cancelled-after-payment", "a cancelled order cannot be cancelled"),
    ],
)
def test_cancel_once_shipped_or_cancelled_is_a_rule_violation(given, status, message):
    given(ORDER, *HISTORIES[status]).when(CancelOrder("too late")).then_rejected(
        "rule_violated", message_contains=message
    )


# evolve


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("placed", "placed"),
        ("paid", "paid"),
        ("shipped", "shipped"),
        ("cancelled", "cancelled"),
        ("cancelled-after-payment", "cancelled"),
    ],
)
def test_evolve_tracks_status_and_total(given, status, expected):
    state = given(ORDER, *HISTORIES[status]).state
    assert state == Order(customer_id="c-1", total_cents=6995, status=expected, lines=PLACED.lines)
