"""Every row of docs/api.md's error table, against real Kafka: the status, the JSON error body, a
message that helps, and that a refused command left the log exactly as it was."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jwt
import pytest
from flask.testing import FlaskClient
from kafka import TopicPartition
from werkzeug.test import TestResponse

from app import close_app, create_app
from commands.messages import CommandMessage, Reply
from commands.processor import CommandProcessor
from config.settings import JWT_AUDIENCE, Settings
from config.topics import Topics
from events.partitioning import partition_for
from events.serialization import Envelope
from events.store import committed_reader, read_to_end
from stack.procs import wait_until
from tests.support import SECRET, log_of, new_deployment, token

AUTH = {"Authorization": f"Bearer {token()}"}
ERROR_CODES = {
    "malformed_json",
    "unauthorized",
    "forbidden",
    "not_found",
    "method_not_allowed",
    "version_conflict",
    "rule_violated",
    "payload_too_large",
    "unsupported_media_type",
    "validation_failed",
    "idempotency_key_reused",
    "unavailable",
    "timeout",
}


# --- helpers ---------------------------------------------------------------------------------


def send(
    client: FlaskClient,
    name: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
    auth: bool = True,
) -> TestResponse:
    """POST /commands/<name> with `body` as JSON, or `raw` bytes as they are."""
    all_headers = {**(AUTH if auth else {}), **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    kwargs: dict[str, Any] = {"data": data, "headers": all_headers}
    if content_type is not None:
        kwargs["content_type"] = content_type
    return client.post(f"/commands/{name}", **kwargs)


def error_of(r: TestResponse, status: int, code: str) -> dict[str, Any]:
    """Assert the docs/api.md error shape and return `error`."""
    assert r.status_code == status, r.get_data(as_text=True)[:2000]
    assert r.mimetype == "application/json", r.headers
    error = r.get_json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and len(error["message"]) >= 15, error
    assert isinstance(error["details"], list)
    return error


def fields_of(error: dict[str, Any]) -> set[str]:
    return {d["field"] for d in error["details"]}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def events_of(settings: Settings, aggregate_type: str, aggregate_id: str) -> list[Envelope]:
    return [e for e in log_of(settings, aggregate_type) if e.aggregate_id == aggregate_id]


def commands_sent(settings: Settings) -> int:
    """How many records the commands topic holds (the sum of its end offsets)."""
    consumer = committed_reader(settings.kafka())
    try:
        topic = Topics(settings.topic_prefix).commands
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        return sum(consumer.end_offsets(tps).values())
    finally:
        consumer.close()


@contextmanager
def nothing_sent(settings: Settings) -> Iterator[None]:
    """The request was refused by the API itself: no command reached Kafka."""
    before = commands_sent(settings)
    yield
    assert commands_sent(settings) == before


@contextmanager
def log_unchanged(settings: Settings, aggregate_type: str, aggregate_id: str) -> Iterator[None]:
    before = events_of(settings, aggregate_type, aggregate_id)
    yield
    assert events_of(settings, aggregate_type, aggregate_id) == before


def created(r: TestResponse) -> dict[str, Any]:
    assert r.status_code == 201, r.get_data(as_text=True)
    body: dict[str, Any] = r.get_json()
    return body


def register(client: FlaskClient) -> str:
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    created(send(client, "register-customer", body))
    return cid


def add_book(client: FlaskClient, price_cents: int = 1250) -> str:
    bid = new_id("book")
    data = {"title": "Ulysses", "author": "Joyce", "price_cents": price_cents, "royalty_rate": 0.1}
    created(send(client, "add-book", {"aggregate_id": bid, "data": data}))
    return bid


def place_order(client: FlaskClient, quantity: int = 2) -> tuple[str, int]:
    """A placed order and its total."""
    customer, book = register(client), add_book(client, 1250)
    oid = new_id("order")
    data = {"customer_id": customer, "lines": [{"book_id": book, "quantity": quantity}]}
    created(send(client, "place-order", {"aggregate_id": oid, "data": data}))
    return oid, 1250 * quantity


# --- 400 malformed_json ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"data": {"name": "Ann"',
        b"{'data': {}}",
        b"",
        b"   ",
        b'{"data": {}} trailing',
        b"\xff\xfe",
    ],
    ids=["truncated", "single-quotes", "empty", "blank", "trailing-garbage", "not-utf8"],
)
def test_a_body_that_is_not_json_is_400_malformed_json(
    client: FlaskClient, deployment: Settings, raw: bytes
) -> None:
    with nothing_sent(deployment):
        error = error_of(send(client, "register-customer", raw=raw), 400, "malformed_json")
    assert "not valid JSON" in error["message"]


# --- 401 unauthorized ------------------------------------------------------------------------


def _claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = {"sub": "t", "scope": "commands:write", "iss": "logfold", "aud": JWT_AUDIENCE}
    return claims | {"iat": now, "exp": now + 600} | overrides


def _without(claim: str) -> dict[str, Any]:
    return {k: v for k, v in _claims().items() if k != claim}


BAD_AUTH = {
    "no-header": (None, "Authorization: Bearer"),
    "empty-bearer": ("Bearer ", "Authorization: Bearer"),
    "other-scheme": ("Basic dXNlcjpwYXNz", "Authorization: Bearer"),
    "garbage-token": ("Bearer not.a.jwt", "invalid token"),
    "other-secret": (
        f"Bearer {jwt.encode(_claims(), 'another-secret-0123456789-0123456789', 'HS256')}",
        "Signature verification failed",
    ),
    "expired": (f"Bearer {token(ttl=-60)}", "expired"),
    "alg-none": (f"Bearer {jwt.encode(_claims(), None, algorithm='none')}", "invalid token"),
    "wrong-issuer": (f"Bearer {jwt.encode(_claims(iss='evil'), SECRET, 'HS256')}", "issuer"),
    "no-scope-claim": (f"Bearer {jwt.encode(_without('scope'), SECRET)}", "scope"),
    "no-audience": (f"Bearer {jwt.encode(_without('aud'), SECRET)}", '"aud"'),
    "other-audience": (f"Bearer {jwt.encode(_claims(aud='another-api'), SECRET)}", "Audience"),
    "no-issued-at": (f"Bearer {jwt.encode(_without('iat'), SECRET)}", '"iat"'),
    "issued-at-text": (f"Bearer {jwt.encode(_claims(iat='1'), SECRET)}", "`iat`"),
    "too-long-lived": (f"Bearer {token(ttl=24 * 3600 + 1)}", "lifetime is too long"),
}


@pytest.mark.parametrize("case", BAD_AUTH, ids=list(BAD_AUTH))
def test_no_or_bad_token_is_401_and_nothing_is_sent(
    client: FlaskClient, deployment: Settings, case: str
) -> None:
    header, hint = BAD_AUTH[case]
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    headers = {"Authorization": header} if header is not None else {}
    with nothing_sent(deployment):
        r = send(client, "register-customer", body, headers=headers, auth=False)
        error = error_of(r, 401, "unauthorized")
    assert hint in error["message"]
    if header is None:
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert events_of(deployment, "customer", cid) == []


# --- 403 forbidden ---------------------------------------------------------------------------


@pytest.mark.parametrize("scopes", [("views:read",), ("admin",), ("views:read", "admin")])
def test_a_token_without_commands_write_is_403(
    client: FlaskClient, deployment: Settings, scopes: tuple[str, ...]
) -> None:
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    headers = {"Authorization": f"Bearer {token(*scopes)}"}
    with nothing_sent(deployment):
        r = send(client, "register-customer", body, headers=headers, auth=False)
        error = error_of(r, 403, "forbidden")
    assert "commands:write" in error["message"]
    assert events_of(deployment, "customer", cid) == []


# --- 404 not_found ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["no-such-command", "register_customer", "Register-Customer", "régister-✓"]
)
def test_an_unknown_command_is_404(client: FlaskClient, deployment: Settings, name: str) -> None:
    with nothing_sent(deployment):
        error = error_of(send(client, name, {"data": {}}), 404, "not_found")
    assert repr(name) in error["message"] and "/openapi.json" in error["message"]


NON_CREATING = {
    "rename-customer": ("customer", {"name": "Bea"}),
    "change-customer-email": ("customer", {"email": "bea@example.com"}),
    "reprice-book": ("book", {"price_cents": 999}),
    "pay-order": ("order", {"amount_cents": 100}),
    "ship-order": ("order", {}),
    "cancel-order": ("order", {"reason": "too slow"}),
}


@pytest.mark.parametrize("name", NON_CREATING)
def test_a_non_creating_command_on_a_missing_aggregate_is_404(
    client: FlaskClient, deployment: Settings, name: str
) -> None:
    aggregate_type, data = NON_CREATING[name]
    missing = new_id("missing")
    r = send(client, name, {"aggregate_id": missing, "data": data})
    error = error_of(r, 404, "not_found")
    assert missing in error["message"] and "does not exist" in error["message"]
    assert events_of(deployment, aggregate_type, missing) == []


# --- 409 version_conflict --------------------------------------------------------------------


@pytest.mark.parametrize("expected", [0, 2, 1000])
def test_a_wrong_expected_version_is_409_with_expected_and_actual(
    client: FlaskClient, deployment: Settings, expected: int
) -> None:
    cid = register(client)
    body = {"aggregate_id": cid, "expected_version": expected, "data": {"name": "Bea"}}
    with log_unchanged(deployment, "customer", cid):
        error = error_of(send(client, "rename-customer", body), 409, "version_conflict")
    assert error["details"] == [{"expected_version": expected, "actual_version": 1}]
    assert f"expected version {expected}" in error["message"] and "1" in error["message"]
    # The processor's state is unchanged too: the right version is still 1.
    body["expected_version"] = 1
    assert created(send(client, "rename-customer", body))["version"] == 2


def test_expected_version_on_a_creating_command_for_a_new_aggregate_is_409(
    client: FlaskClient, deployment: Settings
) -> None:
    cid = new_id("cust")
    body = {
        "aggregate_id": cid,
        "expected_version": 3,
        "data": {"name": "Ann", "email": "ann@example.com"},
    }
    error = error_of(send(client, "register-customer", body), 409, "version_conflict")
    assert error["details"] == [{"expected_version": 3, "actual_version": 0}]
    assert events_of(deployment, "customer", cid) == []


# --- 409 rule_violated -----------------------------------------------------------------------


def test_paying_the_wrong_amount_is_409_rule_violated(
    client: FlaskClient, deployment: Settings
) -> None:
    oid, total = place_order(client)
    with log_unchanged(deployment, "order", oid):
        r = send(client, "pay-order", {"aggregate_id": oid, "data": {"amount_cents": total - 1}})
        error = error_of(r, 409, "rule_violated")
    assert f"amount {total - 1}" in error["message"] and str(total) in error["message"]
    [placed] = events_of(deployment, "order", oid)
    assert placed.type == "OrderPlaced"
    # Still payable with the right amount: the refusal changed no state.
    r = send(client, "pay-order", {"aggregate_id": oid, "data": {"amount_cents": total}})
    assert created(r)["version"] == 2


def test_shipping_an_unpaid_order_is_409_rule_violated(
    client: FlaskClient, deployment: Settings
) -> None:
    oid, _ = place_order(client)
    with log_unchanged(deployment, "order", oid):
        r = send(client, "ship-order", {"aggregate_id": oid, "data": {}})
        error = error_of(r, 409, "rule_violated")
    assert "paid" in error["message"] and "placed" in error["message"]
    assert [e.type for e in events_of(deployment, "order", oid)] == ["OrderPlaced"]


def test_cancelling_a_shipped_order_is_409_rule_violated(
    client: FlaskClient, deployment: Settings
) -> None:
    oid, total = place_order(client)
    created(send(client, "pay-order", {"aggregate_id": oid, "data": {"amount_cents": total}}))
    created(send(client, "ship-order", {"aggregate_id": oid, "data": {}}))
    with log_unchanged(deployment, "order", oid):
        r = send(client, "cancel-order", {"aggregate_id": oid, "data": {"reason": "late"}})
        error = error_of(r, 409, "rule_violated")
    assert "shipped" in error["message"] and "cancel" in error["message"]
    types = [e.type for e in events_of(deployment, "order", oid)]
    assert types == ["OrderPlaced", "OrderPaid", "OrderShipped"]


def test_registering_an_existing_customer_again_is_409_rule_violated(
    client: FlaskClient, deployment: Settings
) -> None:
    cid = register(client)
    body = {"aggregate_id": cid, "data": {"name": "Other", "email": "other@example.com"}}
    with log_unchanged(deployment, "customer", cid):
        error = error_of(send(client, "register-customer", body), 409, "rule_violated")
    assert "already registered" in error["message"]


# --- 413 payload_too_large -------------------------------------------------------------------


def _body_of_length(aggregate_id: str, length: int) -> bytes:
    """A rename-customer body of exactly `length` bytes (its name far over 200 chars)."""
    empty = json.dumps({"aggregate_id": aggregate_id, "data": {"name": ""}}).encode()
    raw = json.dumps({"aggregate_id": aggregate_id, "data": {"name": "x" * (length - len(empty))}})
    assert len(raw.encode()) == length
    return raw.encode()


def test_a_body_over_64_kib_is_413_and_nothing_is_sent(
    client: FlaskClient, deployment: Settings
) -> None:
    cid = register(client)
    with log_unchanged(deployment, "customer", cid), nothing_sent(deployment):
        r = send(client, "rename-customer", raw=_body_of_length(cid, 64 * 1024 + 1))
        error = error_of(r, 413, "payload_too_large")
        assert str(64 * 1024) in error["message"]
        # At exactly the limit the body is read, and refused only for what it says.
        r = send(client, "rename-customer", raw=_body_of_length(cid, 64 * 1024))
        assert "data.name" in fields_of(error_of(r, 422, "validation_failed"))


# --- 415 unsupported_media_type --------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", None, "application/x-www-form-urlencoded", "application/jsonx"],
    ids=["text-plain", "none", "form", "jsonx"],
)
def test_a_body_that_is_not_application_json_is_415(
    client: FlaskClient, deployment: Settings, content_type: str | None
) -> None:
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    raw = json.dumps(body).encode()
    with nothing_sent(deployment):
        r = send(client, "register-customer", raw=raw, content_type=content_type)
        error = error_of(r, 415, "unsupported_media_type")
    assert "application/json" in error["message"]
    assert events_of(deployment, "customer", cid) == []


def test_application_json_with_a_charset_is_accepted(client: FlaskClient) -> None:
    body = {"data": {"name": "Ann", "email": "ann@example.com"}}
    created(send(client, "register-customer", body, content_type="application/json; charset=utf-8"))


# --- 422 validation_failed -------------------------------------------------------------------


def test_every_bad_field_is_listed_in_one_422(client: FlaskClient, deployment: Settings) -> None:
    body = {
        "aggregate_id": "not a valid id!",
        "expected_version": -1,
        "surprise": True,
        "data": {
            "title": "",
            "author": "x" * 201,
            "price_cents": 0,
            "royalty_rate": 0.75,
            "isbn": "978-0",
        },
    }
    with nothing_sent(deployment):
        error = error_of(send(client, "add-book", body), 422, "validation_failed")
    assert fields_of(error) == {
        "aggregate_id",
        "expected_version",
        "surprise",
        "data.title",
        "data.author",
        "data.price_cents",
        "data.royalty_rate",
        "data.isbn",
    }
    assert all(d["problem"] for d in error["details"])
    assert "add-book" in error["message"]


def test_every_bad_order_line_is_listed(client: FlaskClient, deployment: Settings) -> None:
    lines = [
        {"book_id": "b1", "quantity": 0},
        {"book_id": "", "quantity": "2"},
        {"book_id": "b3", "quantity": 1001},
    ]
    body = {"data": {"customer_id": "c 1", "lines": lines}}
    with nothing_sent(deployment):
        error = error_of(send(client, "place-order", body), 422, "validation_failed")
    assert fields_of(error) == {
        "data.customer_id",
        "data.lines.0.quantity",
        "data.lines.1.book_id",
        "data.lines.1.quantity",
        "data.lines.2.quantity",
    }


@pytest.mark.parametrize(
    ("name", "body", "fields"),
    [
        ("register-customer", {"data": {}}, {"data.name", "data.email"}),
        ("register-customer", {"data": {"name": "A", "email": "nope"}}, {"data.email"}),
        ("rename-customer", {"data": {"name": "Bea"}}, {"aggregate_id"}),
        ("place-order", {"data": {"customer_id": "c", "lines": []}}, {"data.lines"}),
        ("pay-order", {"aggregate_id": "o", "data": {"amount_cents": "5"}}, {"data.amount_cents"}),
        ("ship-order", {"aggregate_id": "o", "data": {"note": "x"}}, {"data.note"}),
    ],
    ids=["missing", "bad-email", "no-aggregate-id", "no-lines", "string-amount", "extra-field"],
)
def test_invalid_commands_are_422_with_each_field(
    client: FlaskClient, deployment: Settings, name: str, body: Any, fields: set[str]
) -> None:
    with nothing_sent(deployment):
        error = error_of(send(client, name, body), 422, "validation_failed")
    assert fields_of(error) == fields


@pytest.mark.parametrize("body", [[], [{"data": {}}], "text", 42, None], ids=repr)
def test_a_body_that_is_not_an_object_is_422(
    client: FlaskClient, deployment: Settings, body: Any
) -> None:
    with nothing_sent(deployment):
        error = error_of(send(client, "register-customer", body), 422, "validation_failed")
    assert "object" in error["message"]


@pytest.mark.parametrize("key", ["k" * 129, "k" * 1000, ""], ids=["129", "1000", "empty"])
def test_an_idempotency_key_outside_1_to_128_chars_is_422(
    client: FlaskClient, deployment: Settings, key: str
) -> None:
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    with nothing_sent(deployment):
        r = send(client, "register-customer", body, headers={"Idempotency-Key": key})
        error = error_of(r, 422, "validation_failed")
    assert error["details"] == [
        {"field": "Idempotency-Key", "problem": "must be 1 to 128 characters"}
    ]
    assert events_of(deployment, "customer", cid) == []
    # 128 characters is still fine.
    created(send(client, "register-customer", body, headers={"Idempotency-Key": "k" * 128}))


@pytest.mark.parametrize(
    "value",
    ["c" * 129, "two words", "tab\there", "ünïcode", "bell\x07", "\x1b[31mred"],
    ids=["129", "space", "tab", "non-ascii", "control", "escape"],
)
def test_a_bad_correlation_id_is_422_and_never_reaches_an_event(
    client: FlaskClient, deployment: Settings, value: str
) -> None:
    """An X-Correlation-Id is kept in the command's events for ever (events are immutable)."""
    cid = new_id("cust")
    body = {"aggregate_id": cid, "data": {"name": "Ann", "email": "ann@example.com"}}
    with nothing_sent(deployment):
        r = send(client, "register-customer", body, headers={"X-Correlation-Id": value})
        error = error_of(r, 422, "validation_failed")
    assert [d["field"] for d in error["details"]] == ["X-Correlation-Id"]
    assert events_of(deployment, "customer", cid) == []
    created(send(client, "register-customer", body, headers={"X-Correlation-Id": "c" * 128}))


def test_placing_an_order_for_an_unknown_customer_and_books_is_422(
    client: FlaskClient, deployment: Settings
) -> None:
    book = add_book(client)
    oid = new_id("order")
    lines = [
        {"book_id": "no-such-book", "quantity": 1},
        {"book_id": book, "quantity": 1},
        {"book_id": "nor-this-one", "quantity": 2},
    ]
    body = {"aggregate_id": oid, "data": {"customer_id": "no-such-customer", "lines": lines}}
    error = error_of(send(client, "place-order", body), 422, "validation_failed")
    assert fields_of(error) == {"data.customer_id", "data.lines.0.book_id", "data.lines.2.book_id"}
    assert "no-such-customer" in json.dumps(error["details"])
    assert events_of(deployment, "order", oid) == []


def test_placing_an_order_for_a_known_customer_and_an_unknown_book_is_422(
    client: FlaskClient, deployment: Settings
) -> None:
    customer = register(client)
    oid = new_id("order")
    lines = [{"book_id": new_id("ghost"), "quantity": 1}]
    body = {"aggregate_id": oid, "data": {"customer_id": customer, "lines": lines}}
    error = error_of(send(client, "place-order", body), 422, "validation_failed")
    assert error["details"] == [{"field": "data.lines.0.book_id", "problem": "unknown book"}]
    assert events_of(deployment, "order", oid) == []


# --- 422 idempotency_key_reused --------------------------------------------------------------


def test_a_key_reused_for_a_different_creating_command_is_422(
    client: FlaskClient, deployment: Settings
) -> None:
    key = f"key-{uuid.uuid4()}"
    first = {"data": {"name": "Ann", "email": "ann@example.com"}}
    cid = created(send(client, "register-customer", first, headers={"Idempotency-Key": key}))[
        "aggregate_id"
    ]
    other = {"data": {"name": "Someone Else", "email": "else@example.com"}}
    with log_unchanged(deployment, "customer", cid):
        r = send(client, "register-customer", other, headers={"Idempotency-Key": key})
        error = error_of(r, 422, "idempotency_key_reused")
    assert "Idempotency-Key" in error["message"]
    [event] = events_of(deployment, "customer", cid)
    assert event.data == {"name": "Ann", "email": "ann@example.com"}


def test_a_key_reused_for_a_different_update_is_422(
    client: FlaskClient, deployment: Settings
) -> None:
    cid = register(client)
    key = f"key-{uuid.uuid4()}"
    rename = {"aggregate_id": cid, "data": {"name": "Bea"}}
    created(send(client, "rename-customer", rename, headers={"Idempotency-Key": key}))
    with log_unchanged(deployment, "customer", cid):
        for body in (
            {"aggregate_id": cid, "data": {"name": "Cat"}},
            {"aggregate_id": cid, "expected_version": 2, "data": {"name": "Bea"}},
        ):
            r = send(client, "rename-customer", body, headers={"Idempotency-Key": key})
            error_of(r, 422, "idempotency_key_reused")
    assert [e.data.get("name") for e in events_of(deployment, "customer", cid)] == ["Ann", "Bea"]


# --- 504 timeout -----------------------------------------------------------------------------


def _same_partition_id(aggregate_id: str, partitions: int) -> str:
    want = partition_for(aggregate_id, partitions)
    while True:
        candidate = new_id("fresh")
        if partition_for(candidate, partitions) == want:
            return candidate


def test_an_unanswered_command_is_504_and_expires_unprocessed(base_settings: Settings) -> None:
    settings = new_deployment(base_settings, command_timeout_s=2)
    topics = Topics(settings.topic_prefix)
    app = create_app(settings)
    client = app.test_client()
    try:
        late = new_id("late")
        body = {"aggregate_id": late, "data": {"name": "Late", "email": "late@example.com"}}
        started = time.monotonic()
        error = error_of(send(client, "register-customer", body), 504, "timeout")
        waited = time.monotonic() - started
        assert "Idempotency-Key" in error["message"] and "expires" in error["message"]
        assert 2 <= waited < 2 + settings.clock_skew_s + 1 + 10
        # It did reach the commands topic: only its deadline keeps it from being applied.
        [sent] = [
            m
            for m in (
                CommandMessage.decode(r.value)
                for r in read_to_end(settings.kafka(), topics.commands)
            )
            if m.aggregate_id == late
        ]

        processor = CommandProcessor(settings)
        thread = threading.Thread(target=processor.run, name="late-processor", daemon=True)
        thread.start()
        try:
            # Same partition: once one is answered, the late command before it was decided.
            # A new aggregate per attempt, as an attempt that timed out may still be applied.
            accepted: list[str] = []

            def fresh_accepted() -> bool:
                fresh = _same_partition_id(late, settings.partitions)
                data = {"name": "Fresh", "email": "fresh@example.com"}
                r = send(client, "register-customer", {"aggregate_id": fresh, "data": data})
                if r.status_code == 201:
                    accepted.append(fresh)
                return bool(accepted)

            wait_until(fresh_accepted, 90, "a fresh command to be processed")
        finally:
            processor.stop()
            thread.join(timeout=30)
        assert events_of(settings, "customer", late) == []
        assert len(events_of(settings, "customer", accepted[0])) == 1
        replies = [
            reply
            for r in read_to_end(settings.kafka(), topics.replies)
            for reply in Reply.decode_many(r.value)
        ]
        [refused] = [r for r in replies if r.command_id == sent.command_id]
        assert refused.status == 504 and refused.body["error"]["code"] == "timeout"
    finally:
        close_app(app)


# --- no input produces a 500 ----------------------------------------------------------------


def _random_bytes(n: int, seed: int = 7) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(n))


GOOD_CUSTOMER = {"name": "Ann", "email": "ann@example.com"}

GARBAGE: dict[str, tuple[dict[str, Any], int, str]] = {
    "random-bytes": ({"raw": _random_bytes(4096)}, 400, "malformed_json"),
    "deeply-nested-array": ({"raw": b"[" * 30000 + b"]" * 30000}, 400, "malformed_json"),
    "deeply-nested-object": (
        {"raw": b'{"a":' * 10000 + b"1" + b"}" * 10000},
        400,
        "malformed_json",
    ),
    "deeply-nested-data": (
        {"raw": b'{"data":' + b"[" * 30000 + b"]" * 30000 + b"}"},
        400,
        "malformed_json",
    ),
    "int-with-5000-digits": (
        {"raw": b'{"expected_version": 1' + b"0" * 5000 + b', "data": {}}'},
        400,
        "malformed_json",
    ),
    "aggregate-id-int": ({"body": {"aggregate_id": 42, "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-list": ({"body": {"aggregate_id": ["a"], "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-object": ({"body": {"aggregate_id": {"a": 1}, "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-bool": ({"body": {"aggregate_id": True, "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-empty": ({"body": {"aggregate_id": "", "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-65-chars": ({"body": {"aggregate_id": "a" * 65, "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-unicode": ({"body": {"aggregate_id": "ünï-✓", "data": GOOD_CUSTOMER}}, 422, ""),
    "aggregate-id-slash": ({"body": {"aggregate_id": "../x", "data": GOOD_CUSTOMER}}, 422, ""),
    "expected-version-string": (
        {"body": {"expected_version": "3", "data": GOOD_CUSTOMER}},
        422,
        "",
    ),
    "expected-version-float": ({"body": {"expected_version": 1.5, "data": GOOD_CUSTOMER}}, 422, ""),
    "expected-version-bool": ({"body": {"expected_version": True, "data": GOOD_CUSTOMER}}, 422, ""),
    "expected-version-list": ({"body": {"expected_version": [1], "data": GOOD_CUSTOMER}}, 422, ""),
    "expected-version-negative": (
        {"body": {"expected_version": -1, "data": GOOD_CUSTOMER}},
        422,
        "",
    ),
    "expected-version-huge": (
        {"body": {"expected_version": 10**30, "data": GOOD_CUSTOMER}},
        409,
        "version_conflict",
    ),
    "data-string": ({"body": {"data": "x"}}, 422, ""),
    "data-null": ({"body": {"data": None}}, 422, ""),
    "data-list": ({"body": {"data": [GOOD_CUSTOMER]}}, 422, ""),
    "name-wrong-type": ({"body": {"data": {"name": 7, "email": ["a@b.c"]}}}, 422, ""),
    "nan-literal": ({"raw": b'{"data": {"name": NaN, "email": Infinity}}'}, 422, ""),
    "lone-surrogate-name": (
        {"raw": b'{"data": {"name": "\\ud800", "email": "a@example.com"}}'},
        422,
        "",
    ),
    "lone-surrogate-key": ({"raw": b'{"data": {"\\udfff": 1}, "\\ud800": 2}'}, 422, ""),
    "unicode-command-name": ({"name": "регистрация-клиента", "body": {"data": {}}}, 404, ""),
    "emoji-command-name": ({"name": "😀", "body": {"data": {}}}, 404, ""),
    "nul-command-name": ({"name": "%00", "body": {"data": {}}}, 404, ""),
    "latin1-body": (
        {"raw": '{"data": {"name": "Zoë"}}'.encode("latin-1"), "ct": "application/json"},
        400,
        "malformed_json",
    ),
    "huge-idempotency-key": (
        {"body": {"data": GOOD_CUSTOMER}, "headers": {"Idempotency-Key": "k" * 8000}},
        422,
        "",
    ),
    "unicode-bearer-token": (
        {"body": {"data": GOOD_CUSTOMER}, "headers": {"Authorization": "Bearer Zoë"}},
        401,
        "unauthorized",
    ),
}


@pytest.mark.parametrize("case", GARBAGE, ids=list(GARBAGE))
def test_garbage_gets_a_json_4xx_never_a_500(
    client: FlaskClient, deployment: Settings, case: str
) -> None:
    spec, status, code = GARBAGE[case]
    name = spec.get("name", "register-customer")
    r = send(
        client,
        name,
        spec.get("body"),
        raw=spec.get("raw"),
        content_type=spec.get("ct", "application/json"),
        headers=spec.get("headers"),
    )
    error = error_of(r, status, code or ("not_found" if status == 404 else "validation_failed"))
    assert error["code"] in ERROR_CODES


@pytest.mark.parametrize("method", ["GET", "PUT", "PATCH", "DELETE", "BREW"])
def test_another_method_on_a_command_is_405_json(client: FlaskClient, method: str) -> None:
    r = client.open("/commands/register-customer", method=method, headers=AUTH)
    error = error_of(r, 405, "method_not_allowed")
    assert method not in r.headers["Allow"] and "POST" in r.headers["Allow"]
    assert error["code"] in ERROR_CODES


@pytest.mark.parametrize("path", ["/commands/", "/commands", "/nothing-here", "/commands/a/b"])
def test_unknown_paths_are_404_json(client: FlaskClient, path: str) -> None:
    r = client.post(path, json={"data": {}}, headers=AUTH)
    error_of(r, 404, "not_found")
