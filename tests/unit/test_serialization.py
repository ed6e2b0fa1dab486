import json
from dataclasses import dataclass

import pytest

from events.book import BookAdded, BookRepriced
from events.catalog import EVENT_TYPES
from events.customer import (
    CustomerEmailChanged,
    CustomerErased,
    CustomerRegistered,
    CustomerRenamed,
)
from events.order import OrderCancelled, OrderPaid, OrderPlaced, OrderShipped, PlacedLine
from events.serialization import decode, dumps, encode, envelope_for
from events.upcasting import UPCASTERS, UnknownSchemaVersion, upcast

META = {
    "event_id": "0b7c6c1e-5a8e-4a53-9a55-1f0d7f1c2a11",
    "aggregate_type": "order",
    "aggregate_id": "o-1",
    "version": 3,
    "occurred_at": "2024-05-01T12:00:00+00:00",
    "command_id": "cmd-1",
    "correlation_id": "corr-1",
    "causation_id": "cause-1",
}

SAMPLES = [
    CustomerRegistered(name="Ann Lee", email="ann@example.com"),
    CustomerRenamed(name="Ann Park"),
    CustomerEmailChanged(email="ann@park.example"),
    BookAdded(title="Dune", author="Frank Herbert", price_cents=1999, royalty_rate=0.1),
    BookRepriced(price_cents=2499),
    OrderPlaced(
        customer_id="c-1",
        lines=(
            PlacedLine("b-dune", 2, 1999, "Frank Herbert", 0.1),
            PlacedLine("b-emma", 3, 999, "Jane Austen", 0.0),
        ),
        total_cents=6995,
    ),
    OrderPaid(
        amount_cents=6995,
        lines=(PlacedLine("b-1", 2, 1999, "Frank Herbert", 0.1),),
    ),
    OrderShipped(),
    OrderCancelled(reason="changed my mind"),
    CustomerErased(),
]


def stored(event_type: str, schema_version: int, data: dict) -> bytes:
    """A record as it might sit in the log, written by any version of the code."""
    doc = {**META, "type": event_type, "schema_version": schema_version, "data": data}
    return json.dumps(doc).encode()


def test_every_event_type_has_a_sample():
    assert {type(e).type_name() for e in SAMPLES} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(event):
    envelope = envelope_for(event, **META)
    decoded = decode(encode(envelope))
    assert decoded == envelope
    assert decoded.event() == event
    assert type(decoded.event()) is type(event)


def test_envelope_carries_type_version_and_metadata():
    envelope = envelope_for(BookRepriced(price_cents=2499), **META)
    doc = json.loads(encode(envelope))
    assert doc == {
        **META,
        "type": "BookRepriced",
        "schema_version": 1,
        "data": {"price_cents": 2499},
    }


def test_placed_lines_are_stored_as_a_list_of_objects_and_come_back_as_tuples():
    order = SAMPLES[5]
    raw = encode(envelope_for(order, **META))
    assert json.loads(raw)["data"]["lines"][0] == {
        "book_id": "b-dune",
        "quantity": 2,
        "unit_price_cents": 1999,
        "author": "Frank Herbert",
        "royalty_rate": 0.1,
    }
    lines = decode(raw).event().lines
    assert isinstance(lines, tuple)
    assert all(isinstance(line, PlacedLine) for line in lines)


def test_decode_accepts_bytes_and_str():
    raw = encode(envelope_for(SAMPLES[1], **META))
    assert decode(raw) == decode(raw.decode())


def test_an_integer_royalty_rate_in_a_stored_record_decodes_as_float():
    raw = stored(
        "BookAdded",
        1,
        {"title": "Dune", "author": "Frank Herbert", "price_cents": 1999, "royalty_rate": 0},
    )
    event = decode(raw).event()
    assert event == BookAdded("Dune", "Frank Herbert", 1999, 0.0)
    assert isinstance(event.royalty_rate, float)


# upcasting


def test_customer_registered_v1_is_upcast_to_v2():
    raw = stored("CustomerRegistered", 1, {"full_name": "Ann Lee", "email": "ann@example.com"})
    envelope = decode(raw)
    assert envelope.schema_version == 2
    assert envelope.data == {"name": "Ann Lee", "email": "ann@example.com"}
    assert envelope.event() == CustomerRegistered(name="Ann Lee", email="ann@example.com")
    assert (envelope.event_id, envelope.version) == (META["event_id"], META["version"])


def test_current_version_is_not_touched():
    raw = stored("CustomerRegistered", 2, {"name": "Ann Lee", "email": "ann@example.com"})
    assert decode(raw).data == {"name": "Ann Lee", "email": "ann@example.com"}


def test_upcasting_does_not_modify_the_callers_data():
    data = {"full_name": "Ann Lee", "email": "ann@example.com"}
    assert upcast("CustomerRegistered", 1, data, 2) == {
        "name": "Ann Lee",
        "email": "ann@example.com",
    }
    assert data == {"full_name": "Ann Lee", "email": "ann@example.com"}


def test_a_version_newer_than_the_code_is_refused():
    raw = stored("CustomerRegistered", 3, {"name": "Ann Lee", "email": "ann@example.com"})
    with pytest.raises(UnknownSchemaVersion, match="newer than this code"):
        decode(raw)


def test_a_missing_upcaster_is_refused(monkeypatch):
    monkeypatch.delitem(UPCASTERS, ("CustomerRegistered", 1))
    raw = stored("CustomerRegistered", 1, {"full_name": "Ann Lee", "email": "ann@example.com"})
    with pytest.raises(UnknownSchemaVersion, match="no upcaster for CustomerRegistered v1"):
        decode(raw)


def test_an_old_version_without_any_upcaster_is_refused():
    with pytest.raises(UnknownSchemaVersion, match="no upcaster for CustomerRenamed v0"):
        decode(stored("CustomerRenamed", 0, {"name": "Ann"}))


def test_upcasters_chain_one_version_at_a_time(monkeypatch):
    monkeypatch.setitem(UPCASTERS, ("Thing", 1), lambda d: {"b": d["a"]})
    monkeypatch.setitem(UPCASTERS, ("Thing", 2), lambda d: {"c": d["b"] + 1})
    assert upcast("Thing", 1, {"a": 1}, 3) == {"c": 2}
    assert upcast("Thing", 2, {"b": 1}, 3) == {"c": 2}


@dataclass(frozen=True)
class CommandMessageLike:
    expected_version: int


def test_records_are_compact_utf8_json_even_past_64_bit_integers():
    assert dumps({"name": "Zoë", "n": [1, 2.5]}) == '{"name":"Zoë","n":[1,2.5]}'.encode()
    huge = CommandMessageLike(10**30)
    assert json.loads(dumps(huge)) == {"expected_version": 10**30}
