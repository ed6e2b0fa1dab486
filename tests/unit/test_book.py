from commands.book import AddBook, Book, RepriceBook
from commands.registry import AGGREGATES
from events.book import BookAdded, BookRepriced

BOOK = AGGREGATES["book"]

ADDED = BookAdded(title="Dune", author="Frank Herbert", price_cents=1999, royalty_rate=0.1)


def test_add_a_new_book(given):
    given(BOOK).when(AddBook("Dune", "Frank Herbert", 1999, 0.1)).then(ADDED)


def test_add_an_existing_book_is_a_rule_violation(given):
    given(BOOK, ADDED).when(AddBook("Emma", "Jane Austen", 999, 0.2)).then_rejected(
        "rule_violated", message_contains="already exists", details=[]
    )


def test_reprice(given):
    given(BOOK, ADDED).when(RepriceBook(2499)).then(BookRepriced(price_cents=2499))


def test_evolve_keeps_the_latest_price(given):
    state = given(BOOK, ADDED, BookRepriced(price_cents=2499), BookRepriced(price_cents=1499)).state
    assert state == Book(title="Dune", author="Frank Herbert", price_cents=1499, royalty_rate=0.1)
