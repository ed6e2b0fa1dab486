"""The read API (`GET /views…`, read-your-writes, per-projection health and metrics) on real
Postgres and Kafka, without Spark: the tests write view rows and projection progress with SQL,
so they decide exactly what the API sees."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import psycopg
import pytest
from flask.testing import FlaskClient
from kafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from psycopg.types.json import Jsonb
from werkzeug.test import TestResponse

from app.read_model import ReadModel
from commands.messages import LogPosition
from commands.registry import AGGREGATES
from config.settings import Settings
from config.topics import Topics
from projections.registry import PROJECTIONS, VIEWS
from stack.procs import wait_until
from tests.support import fill_log, health_component, new_deployment, token

pytestmark = pytest.mark.integration

READER = {"Authorization": f"Bearer {token('views:read')}"}
WRITER = {"Authorization": f"Bearer {token('commands:write')}"}
ADMIN = {"Authorization": f"Bearer {token('admin')}"}
EVERYTHING = {"Authorization": f"Bearer {token()}"}


# --- helpers ---------------------------------------------------------------------------------


def sql(settings: Settings, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def set_progress(
    settings: Settings, projection: str, offsets: dict[str, int], late_events: int = 0
) -> None:
    sql(
        settings,
        "INSERT INTO projection_progress (projection, offsets, late_events, updated_at) "
        "VALUES (%s, %s, %s, now()) ON CONFLICT (projection) DO UPDATE SET "
        "offsets = excluded.offsets, late_events = excluded.late_events, updated_at = now()",
        (projection, Jsonb(offsets), late_events),
    )


def add_customer(
    settings: Settings,
    customer_id: str,
    name: str = "Ann",
    email: str = "ann@example.com",
    registered_at: str = "2024-03-01T10:00:00+00:00",
) -> None:
    sql(
        settings,
        "INSERT INTO customers (customer_id, name, email, registered_at, version) "
        "VALUES (%s, %s, %s, %s, 1)",
        (customer_id, name, email, registered_at),
    )


def add_order(settings: Settings, order_id: str, customer_id: str, status: str) -> None:
    sql(
        settings,
        "INSERT INTO orders (order_id, customer_id, status, total_cents, line_count, placed_at, "
        "paid_at, shipped_at, version) VALUES (%s, %s, %s, 1998, 1, "
        "'2024-04-01T08:00:00Z', NULL, NULL, 1)",
        (order_id, customer_id, status),
    )


def b64(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def error_of(r: TestResponse, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.get_data(as_text=True))
    assert r.mimetype == "application/json"
    error: dict[str, Any] = r.json["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["details"], list)
    return error


def fields_of(error: dict[str, Any]) -> set[str]:
    return {d.get("field") for d in error["details"] if isinstance(d, dict)}


def walk(client: FlaskClient, url: str, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of `url` with `limit`, following `next` (bounded, so a loop fails)."""
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    for _ in range(1000):
        sep = "&" if "?" in url else "?"
        page_url = f"{url}{sep}limit={limit}" + (f"&cursor={quote(cursor)}" if cursor else "")
        r = client.get(page_url, headers=READER)
        assert r.status_code == 200, r.json
        assert set(r.json) == {"rows", "next"}
        pages.append(r.json["rows"])
        cursor = r.json["next"]
        if cursor is None:
            return pages
        assert isinstance(cursor, str) and cursor
    raise AssertionError("pagination never ended")


RECORDED = 20  # records in each partition of each events topic, before any command


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    """The module's deployment, with a log in which the positions its tests wait for exist (a
    position past the log's end is refused at once). The records are not events: no projector
    runs here, the tests write view rows and progress themselves. Written before the command
    processor starts, which takes the log's ends as they are then."""
    settings = new_deployment(base_settings)
    for aggregate in AGGREGATES:
        fill_log(
            settings, Topics(settings.topic_prefix).events(aggregate), settings.partitions, RECORDED
        )
    return settings


@pytest.fixture(scope="module")
def topics(deployment: Settings) -> Topics:
    return Topics(deployment.topic_prefix)


@pytest.fixture
def model(client: FlaskClient) -> ReadModel:
    found: ReadModel = client.application.extensions["logfold.read_model"]
    return found


# --- GET /views ------------------------------------------------------------------------------


def test_list_views_describes_every_view_with_its_lag(client: FlaskClient) -> None:
    r = client.get("/views", headers=READER)
    assert r.status_code == 200 and r.mimetype == "application/json"
    views = {v["name"]: v for v in r.json["views"]}
    assert set(views) == set(VIEWS)
    assert len(r.json["views"]) == len(VIEWS)
    for name, (_, output) in VIEWS.items():
        v = views[name]
        assert v["key"] == list(output.key) and v["key"], name
        assert v["filterable"] == list(output.filterable), name
        assert v["columns"] == list(output.columns), name
        assert set(v["key"]) <= set(v["columns"]) and set(v["filterable"]) <= set(v["columns"])
        lag = v["lag"]
        assert isinstance(lag, dict), (name, lag)
        assert isinstance(lag["events"], int) and lag["events"] >= 0
        assert isinstance(lag["seconds"], int | float) and lag["seconds"] >= 0
        assert isinstance(lag["late_events"], int) and lag["late_events"] >= 0
    assert views["customers"]["key"] == ["customer_id"]
    assert views["sales_by_hour"]["key"] == ["book_id", "window_start"]
    assert views["orders"]["filterable"] == ["customer_id", "status"]


class LostAnswer:
    """A Kafka client whose `end_offsets` fails as kafka-python's does when the broker closed
    the connection its request was on: a KeyError for a partition with no answer."""

    def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        raise KeyError(partitions[0])

    def close(self) -> None:
        pass


def test_a_kafka_client_failure_is_tried_again_on_a_new_client(
    client: FlaskClient, model: ReadModel
) -> None:
    model._ends = (0.0, {})
    model._offsets = LostAnswer()  # type: ignore[assignment]
    r = client.get("/views", headers=READER)
    assert r.status_code == 200, r.json
    assert model._offsets is not None and not isinstance(model._offsets, LostAnswer)


def test_a_kafka_client_failure_that_persists_is_503_not_500(
    client: FlaskClient, model: ReadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    model._ends = (0.0, {})
    model.close_offsets()
    monkeypatch.setattr("app.read_model.KafkaConsumer", lambda **_: LostAnswer())
    r = client.get("/views", headers=READER)
    error_of(r, 503, "unavailable")
    assert r.headers["Retry-After"]
    monkeypatch.undo()
    model._ends = (0.0, {})
    assert client.get("/views", headers=READER).status_code == 200


def test_list_views_lag_shows_late_events_from_progress(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    set_progress(deployment, "sales_by_hour", {f"{topics.events('order')}:0": 0}, late_events=4)
    views = {v["name"]: v for v in client.get("/views", headers=READER).json["views"]}
    assert views["sales_by_hour"]["lag"]["late_events"] == 4
    assert views["late_events"]["lag"]["late_events"] == 4  # same projection, same lag


def test_a_failure_and_its_lost_ranges_are_shown_to_admin_callers_only(
    client: FlaskClient, deployment: Settings
) -> None:
    """The failure's text can quote an event (a customer's data): a views:read token, one
    customer's included, sees that the fold failed and where, not why; `admin` sees it all."""
    failure = "ValueError: cannot fold {'email': 'ann@example.com', 'customer_id': 'c-77'}"
    loss = [{"partition": "x:0", "from_offset": 2, "to_offset": 3, "detected_at": "then"}]
    sql(
        deployment,
        "INSERT INTO projection_progress (projection, error, error_offsets, failed_at, "
        "lost_offsets, data_loss) VALUES ('order_summaries', %s, %s, now(), 1, %s) "
        "ON CONFLICT (projection) DO UPDATE SET error = excluded.error, error_offsets = "
        "excluded.error_offsets, failed_at = now(), lost_offsets = 1, data_loss = "
        "excluded.data_loss",
        (failure, Jsonb({"x:0": 5}), Jsonb(loss)),
    )
    try:
        customer = {"Authorization": f"Bearer {token('views:read', rows={'customer_id': 'c-1'})}"}
        for headers in (customer, READER):
            r = client.get("/views", headers=headers)
            assert r.status_code == 200, r.json
            lag = {v["name"]: v["lag"] for v in r.json["views"]}["order_summaries"]
            assert lag["failed"]["offsets"] == {"x:0": 5} and "error" not in lag["failed"]
            assert lag["lost_offsets"] == 1 and "data_loss" not in lag
            assert "ann@example.com" not in r.get_data(as_text=True)
        admin = {"Authorization": f"Bearer {token('views:read', 'admin')}"}
        r = client.get("/views", headers=admin)
        lag = {v["name"]: v["lag"] for v in r.json["views"]}["order_summaries"]
        assert lag["failed"]["error"] == failure and lag["data_loss"] == loss
    finally:
        sql(
            deployment,
            "UPDATE projection_progress SET error = NULL, error_offsets = NULL, failed_at = NULL, "
            "lost_offsets = 0, data_loss = NULL WHERE projection = 'order_summaries'",
        )


@pytest.mark.parametrize("path", ["/views", "/views/customers", "/views/customers/c-1"])
@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer not-a-jwt"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token('views:read', ttl=-5)}"}, 401, "unauthorized"),
        (WRITER, 403, "forbidden"),
        (ADMIN, 403, "forbidden"),
    ],
    ids=["no-token", "garbage", "expired", "commands-write", "admin-only"],
)
def test_views_need_the_views_read_scope(
    client: FlaskClient, path: str, headers: dict[str, str], status: int, code: str
) -> None:
    r = client.get(path, headers=headers)
    error_of(r, status, code)
    assert "rows" not in r.json and "views" not in r.json


# --- GET /views/<view> -----------------------------------------------------------------------


def test_rows_are_json_with_utc_timestamps(client: FlaskClient, deployment: Settings) -> None:
    cid = uid("ts")
    add_customer(deployment, cid, "Zoë", "zoe@example.com", "2024-03-01T12:34:56.789+02:00")
    expected = {
        "customer_id": cid,
        "name": "Zoë",
        "email": "zoe@example.com",
        "registered_at": "2024-03-01T10:34:56.789000Z",
        "version": 1,
    }
    one = client.get(f"/views/customers/{cid}", headers=READER)
    assert one.status_code == 200 and one.mimetype == "application/json"
    assert one.json == expected
    listed = client.get("/views/customers?email=zoe@example.com", headers=READER)
    assert listed.status_code == 200
    assert listed.json == {"rows": [expected], "next": None}


def test_null_timestamps_are_null(client: FlaskClient, deployment: Settings) -> None:
    oid = uid("o-null")
    add_order(deployment, oid, uid("c"), "placed")
    row = client.get(f"/views/orders/{oid}", headers=READER).json
    assert row["placed_at"] == "2024-04-01T08:00:00Z"
    assert row["paid_at"] is None and row["shipped_at"] is None
    assert row["total_cents"] == 1998 and row["line_count"] == 1


def test_equality_filters_on_filterable_columns(client: FlaskClient, deployment: Settings) -> None:
    ann, bob = uid("c-ann"), uid("c-bob")
    orders = {
        f"{ann}-o1": (ann, "paid"),
        f"{ann}-o2": (ann, "placed"),
        f"{ann}-o3": (ann, "paid"),
        f"{ann}-o4": (ann, "cancelled"),
        f"{bob}-o1": (bob, "paid"),
    }
    for oid, (cid, status) in orders.items():
        add_order(deployment, oid, cid, status)

    r = client.get(
        f"/views/orders?{urlencode({'customer_id': ann, 'status': 'paid'})}", headers=READER
    )
    assert r.status_code == 200, r.json
    assert [x["order_id"] for x in r.json["rows"]] == [f"{ann}-o1", f"{ann}-o3"]
    assert all(x["customer_id"] == ann and x["status"] == "paid" for x in r.json["rows"])
    assert r.json["next"] is None

    r = client.get(f"/views/orders?customer_id={ann}", headers=READER)
    assert [x["order_id"] for x in r.json["rows"]] == sorted(o for o in orders if o.startswith(ann))

    r = client.get(f"/views/orders?customer_id={bob}&status=placed", headers=READER)
    assert r.status_code == 200 and r.json == {"rows": [], "next": None}

    r = client.get(f"/views/orders?customer_id={uid('nobody')}", headers=READER)
    assert r.status_code == 200 and r.json == {"rows": [], "next": None}


@pytest.mark.parametrize(
    ("query", "unknown"),
    [
        ("colour=red", {"colour"}),
        ("total_cents=1998", {"total_cents"}),  # a real column, but not a declared filter
        ("status=paid&colour=red&size=9", {"colour", "size"}),
        ("Status=paid", {"Status"}),
    ],
)
def test_unknown_filter_is_422_naming_the_field(
    client: FlaskClient, query: str, unknown: set[str]
) -> None:
    error = error_of(client.get(f"/views/orders?{query}", headers=READER), 422, "validation_failed")
    assert fields_of(error) == unknown


def test_every_filterable_column_takes_text_or_answers_422(client: FlaskClient) -> None:
    """A value that does not fit the column type is a 422, never a 500 (today every declared
    filter is text; this keeps the rule when someone adds an integer or timestamp filter)."""
    for name, (_, output) in VIEWS.items():
        for column in output.filterable:
            r = client.get(f"/views/{name}?{column}=not-a-value-%C3%A9", headers=READER)
            if output.table.c[column].type.python_type is str:
                assert r.status_code == 200 and r.json["rows"] == [], (name, column, r.json)
            else:
                error_of(r, 422, "validation_failed")


@pytest.fixture(scope="module")
def paged(deployment: Settings) -> tuple[str, list[str]]:
    """120 customers sharing one name, so a filter selects exactly them."""
    name = uid("Paged Person")
    prefix = uid("pg")
    ids = [f"{prefix}-{i:03d}" for i in range(120)]
    with psycopg.connect(deployment.database(), autocommit=True) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO customers (customer_id, name, email, registered_at, version) "
            "VALUES (%s, %s, %s, '2024-01-01T00:00:00Z', 1)",
            [(cid, name, f"{cid}@example.com") for cid in reversed(ids)],
        )
    return name, ids


def test_limit_defaults_to_50(client: FlaskClient, paged: tuple[str, list[str]]) -> None:
    name, ids = paged
    r = client.get(f"/views/customers?{urlencode({'name': name})}", headers=READER)
    assert r.status_code == 200
    assert [x["customer_id"] for x in r.json["rows"]] == ids[:50]
    assert isinstance(r.json["next"], str)


@pytest.mark.parametrize(("limit", "expected"), [(1, 1), (120, 120), (500, 120), (121, 120)])
def test_limit_within_bounds(
    client: FlaskClient, paged: tuple[str, list[str]], limit: int, expected: int
) -> None:
    name, ids = paged
    r = client.get(f"/views/customers?{urlencode({'name': name, 'limit': limit})}", headers=READER)
    assert r.status_code == 200
    assert [x["customer_id"] for x in r.json["rows"]] == ids[:expected]
    assert (r.json["next"] is None) == (limit >= len(ids))


@pytest.mark.parametrize("limit", ["0", "501", "abc", "-1", "", "nan", "inf", "1e9", "0.5"])
def test_limit_out_of_bounds_is_422(client: FlaskClient, limit: str) -> None:
    r = client.get(f"/views/customers?limit={quote(limit)}", headers=READER)
    assert fields_of(error_of(r, 422, "validation_failed")) == {"limit"}


def test_pagination_returns_every_row_once_in_key_order(
    client: FlaskClient, paged: tuple[str, list[str]]
) -> None:
    name, ids = paged
    pages = walk(client, f"/views/customers?{urlencode({'name': name})}", limit=50)
    assert [len(p) for p in pages] == [50, 50, 20]
    assert [x["customer_id"] for p in pages for x in p] == ids
    assert all(x["name"] == name for p in pages for x in p)


def test_pagination_with_a_page_size_that_divides_the_rows(
    client: FlaskClient, paged: tuple[str, list[str]]
) -> None:
    name, ids = paged
    pages = walk(client, f"/views/customers?{urlencode({'name': name})}", limit=40)
    assert [x["customer_id"] for p in pages for x in p] == ids
    assert [len(p) for p in pages if p] == [40, 40, 40]  # an empty last page is allowed


def test_pagination_without_filters_matches_the_table(
    client: FlaskClient, deployment: Settings, paged: tuple[str, list[str]]
) -> None:
    pages = walk(client, "/views/customers", limit=37)
    seen = [x["customer_id"] for p in pages for x in p]
    in_db = [r[0] for r in sql(deployment, "SELECT customer_id FROM customers ORDER BY 1")]
    assert seen == in_db
    assert len(set(seen)) == len(seen) and set(paged[1]) <= set(seen)


def test_pagination_over_a_composite_key(client: FlaskClient, deployment: Settings) -> None:
    book = uid("b-hours")
    hours = [f"2024-05-0{d}T{h:02d}:00:00+00:00" for d in (1, 2) for h in range(0, 24, 2)]
    for at in reversed(hours):
        sql(
            deployment,
            "INSERT INTO sales_by_hour (book_id, window_start, units, revenue_cents) "
            "VALUES (%s, %s, 1, 999)",
            (book, at),
        )
    pages = walk(client, f"/views/sales_by_hour?book_id={book}", limit=5)
    got = [x["window_start"] for p in pages for x in p]
    assert got == [h.replace("+00:00", "Z") for h in hours]
    assert all(x["book_id"] == book for p in pages for x in p)


def test_pagination_and_lookup_over_a_key_holding_a_day(
    client: FlaskClient, deployment: Settings
) -> None:
    """book_conversions is keyed by (book_id, day): its pages' cursors and its rows' keys hold a
    date, which must page and look up like any other key."""
    book = uid("b-days")
    days = ["0001-01-01", *(f"2024-05-{d:02d}" for d in range(1, 12)), "9999-12-31"]
    for day in reversed(days):
        sql(
            deployment,
            "INSERT INTO book_conversions (book_id, day, views, converted_views) "
            "VALUES (%s, %s, 3, 1)",
            (book, day),
        )
    pages = walk(client, f"/views/book_conversions?book_id={book}", limit=4)
    assert [x["day"] for p in pages for x in p] == days
    for day in (days[0], days[5], days[-1]):
        r = client.get(f"/views/book_conversions/{book},{day}", headers=READER)
        assert r.status_code == 200, (day, r.json)
        assert r.json == {"book_id": book, "day": day, "views": 3, "converted_views": 1}
    error_of(
        client.get(f"/views/book_conversions/{book},2024-06-01", headers=READER), 404, "not_found"
    )
    for bad in ("2024-02-30", "tomorrow", "2024-05-01T00:00:00Z"):
        r = client.get(f"/views/book_conversions/{book},{bad}", headers=READER)
        error_of(r, 422, "validation_failed")


@pytest.mark.parametrize(
    "at", ["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+14:00"]
)
def test_a_time_utc_cannot_hold_is_422_as_a_key_and_in_a_cursor(
    client: FlaskClient, at: str
) -> None:
    r = client.get(f"/views/sales_by_hour/b-1,{quote(at)}", headers=READER)
    error_of(r, 422, "validation_failed")
    r = client.get(f"/views/sales_by_hour?cursor={b64(['b-1', at])}", headers=READER)
    error_of(r, 422, "validation_failed")


@pytest.mark.parametrize(
    ("view", "cursor"),
    [
        ("customers", "garbage!!"),
        ("customers", ""),
        ("customers", "%%%%"),
        ("customers", b64({"customer_id": "x"})),
        ("customers", b64(["a", "b"])),  # two values for a one-column key
        ("customers", b64([])),
        ("customers", b64("abc")),
        ("customers", base64.urlsafe_b64encode(b"\xff\xfe[").decode()),
        ("sales_by_hour", b64(["b", "not-a-time"])),
        ("sales_by_hour", b64(["b", 12])),
        ("sales_by_hour", b64(["b", None])),
        ("sales_by_hour", b64(["b"])),
    ],
)
def test_a_garbage_cursor_is_422(client: FlaskClient, view: str, cursor: str) -> None:
    r = client.get(f"/views/{view}?cursor={quote(cursor)}", headers=READER)
    error_of(r, 422, "validation_failed")


def test_unknown_view_is_404(client: FlaskClient) -> None:
    for path in ("/views/nope", "/views/nope/x", "/views/Customers", "/views/projection_progress"):
        error = error_of(client.get(path, headers=READER), 404, "not_found")
        assert "nope" in error["message"] or path.rsplit("/", 1)[-1] in error["message"]


# --- GET /views/<view>/<key> -----------------------------------------------------------------


def test_one_row_by_key_and_404_when_missing(client: FlaskClient, deployment: Settings) -> None:
    cid = uid("one")
    add_customer(deployment, cid, "Una", "una@example.com")
    r = client.get(f"/views/customers/{cid}", headers=READER)
    assert r.status_code == 200 and r.json["customer_id"] == cid and r.json["name"] == "Una"
    error_of(client.get(f"/views/customers/{cid}x", headers=READER), 404, "not_found")
    # a single-column key is taken whole, commas and all
    error_of(client.get(f"/views/customers/{cid},x", headers=READER), 404, "not_found")


def test_composite_key_of_sales_by_hour(client: FlaskClient, deployment: Settings) -> None:
    book = uid("b-win")
    sql(
        deployment,
        "INSERT INTO sales_by_hour (book_id, window_start, units, revenue_cents) VALUES "
        "(%s, '2024-05-01T10:00:00Z', 3, 2997), (%s, '2024-05-01T11:00:00Z', 1, 999)",
        (book, book),
    )
    expected = {
        "book_id": book,
        "window_start": "2024-05-01T10:00:00Z",
        "units": 3,
        "revenue_cents": 2997,
    }
    for at in ("2024-05-01T10:00:00Z", "2024-05-01T10:00:00+00:00", "2024-05-01T12:00:00+02:00"):
        r = client.get(f"/views/sales_by_hour/{book},{quote(at)}", headers=READER)
        assert r.status_code == 200, (at, r.json)
        assert r.json == expected
    r = client.get(f"/views/sales_by_hour/{book},2024-05-01T11:00:00Z", headers=READER)
    assert r.status_code == 200 and r.json["units"] == 1
    error_of(
        client.get(f"/views/sales_by_hour/{book},2024-05-01T12:00:00Z", headers=READER),
        404,
        "not_found",
    )


@pytest.mark.parametrize(
    "key", ["b-1", "b-1,2024-05-01T10:00:00Z,extra", "b-1,2024-05-01T10:00:00Z,"]
)
def test_wrong_number_of_key_parts_is_422(client: FlaskClient, key: str) -> None:
    r = client.get(f"/views/sales_by_hour/{quote(key, safe=',:')}", headers=READER)
    assert fields_of(error_of(r, 422, "validation_failed")) == {"key"}


@pytest.mark.parametrize("when", ["yesterday", "", "2024-13-01T00:00:00Z", "12"])
def test_a_key_part_of_the_wrong_type_is_422(client: FlaskClient, when: str) -> None:
    r = client.get(f"/views/sales_by_hour/b-1,{quote(when)}", headers=READER)
    error_of(r, 422, "validation_failed")


# --- read-your-writes ------------------------------------------------------------------------


def test_a_position_not_yet_applied_times_out_with_the_lag(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    cid = uid("ryw")
    add_customer(deployment, cid)
    topic = topics.events("customer")
    set_progress(deployment, "customers", {f"{topic}:2": 6, f"{topic}:0": 50})
    tok = LogPosition(topic, 2, 7).token()

    started = time.monotonic()
    r = client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=1", headers=READER)
    elapsed = time.monotonic() - started
    error = error_of(r, 504, "timeout")
    lag = error["details"][0]["lag"]
    assert {"events", "seconds", "late_events"} <= set(lag)
    assert 0.9 <= elapsed < 15, elapsed  # it did wait, and not much longer than asked

    # the list endpoint waits the same way
    error_of(
        client.get(f"/views/customers?consistent_with={tok}&wait=0", headers=READER), 504, "timeout"
    )

    set_progress(deployment, "customers", {f"{topic}:2": 7, f"{topic}:0": 50})
    r = client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=1", headers=READER)
    assert r.status_code == 200 and r.json["customer_id"] == cid
    r = client.get(
        f"/views/customers?consistent_with={tok}&wait=0&email=ann@example.com", headers=READER
    )
    assert r.status_code == 200 and cid in [x["customer_id"] for x in r.json["rows"]]
    # an earlier position is included too; a later one is not
    r = client.get(
        f"/views/customers/{cid}?consistent_with={LogPosition(topic, 2, 3).token()}&wait=0",
        headers=READER,
    )
    assert r.status_code == 200
    later = LogPosition(topic, 2, 8).token()
    error_of(
        client.get(f"/views/customers/{cid}?consistent_with={later}&wait=0", headers=READER),
        504,
        "timeout",
    )
    # another partition's progress does not count
    other = LogPosition(topic, 1, 0).token()
    error_of(
        client.get(f"/views/customers/{cid}?consistent_with={other}&wait=0", headers=READER),
        504,
        "timeout",
    )


def test_a_waiting_read_answers_once_progress_catches_up(
    client: FlaskClient,
    deployment: Settings,
    topics: Topics,
    model: ReadModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cid = uid("ryw-wait")
    add_customer(deployment, cid, name="Wes")
    topic = topics.events("customer")
    set_progress(deployment, "customers", {f"{topic}:3": 10})
    tok = LogPosition(topic, 3, 12).token()

    checks: list[bool] = []
    waiting = threading.Event()
    original = model.includes

    def spy(*args: Any) -> bool:
        result = original(*args)
        checks.append(result)
        if not result:
            waiting.set()  # the request has seen the old progress and is waiting
        return result

    monkeypatch.setattr(model, "includes", spy)
    failures: list[BaseException] = []

    def catch_up() -> None:
        try:
            if not waiting.wait(timeout=20):
                raise TimeoutError("the read never started waiting")
            set_progress(deployment, "customers", {f"{topic}:3": 12})
        except BaseException as e:  # reported by the test below
            failures.append(e)

    helper = threading.Thread(target=catch_up, name="catch-up", daemon=True)
    helper.start()
    started = time.monotonic()
    r = client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=25", headers=READER)
    elapsed = time.monotonic() - started
    helper.join(timeout=30)
    assert not helper.is_alive() and not failures, failures
    assert r.status_code == 200, r.json
    assert r.json["name"] == "Wes"
    assert checks[0] is False and checks[-1] is True, checks
    assert elapsed < 20, elapsed  # woke on progress, not at the end of the wait


def test_the_consistency_header(client: FlaskClient, deployment: Settings, topics: Topics) -> None:
    cid = uid("ryw-hdr")
    add_customer(deployment, cid)
    topic = topics.events("customer")
    set_progress(deployment, "customers", {f"{topic}:0": 4})
    tok = LogPosition(topic, 0, 5).token()
    headers = {**READER, "X-Consistent-With": tok}
    error_of(client.get(f"/views/customers/{cid}?wait=0.2", headers=headers), 504, "timeout")
    error_of(client.get("/views/customers?wait=0", headers=headers), 504, "timeout")
    set_progress(deployment, "customers", {f"{topic}:0": 5})
    r = client.get(f"/views/customers/{cid}?wait=0.2", headers=headers)
    assert r.status_code == 200 and r.json["customer_id"] == cid
    assert client.get("/views/customers?wait=0", headers=headers).status_code == 200
    bad = {**READER, "X-Consistent-With": "not a token"}
    r = client.get(f"/views/customers/{cid}", headers=bad)
    assert fields_of(error_of(r, 422, "validation_failed")) == {"consistent_with"}


def test_a_position_on_a_topic_the_projection_does_not_read_is_immediate(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    cid = uid("ryw-other")
    add_customer(deployment, cid)
    set_progress(deployment, "customers", {})
    tok = LogPosition(topics.events("order"), 0, RECORDED - 1).token()
    started = time.monotonic()
    r = client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=10", headers=READER)
    assert r.status_code == 200 and r.json["customer_id"] == cid
    assert time.monotonic() - started < 5
    # but the same position holds back a view whose projection reads orders
    oid = uid("o-ryw")
    add_order(deployment, oid, cid, "placed")
    set_progress(deployment, "orders", {})
    error_of(
        client.get(f"/views/orders/{oid}?consistent_with={tok}&wait=0", headers=READER),
        504,
        "timeout",
    )


def test_a_position_beyond_the_log_is_422_at_once(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    cid = uid("ryw-beyond")
    add_customer(deployment, cid)
    topic = topics.events("customer")
    for position in (
        LogPosition(topic, 0, 10**12),
        LogPosition(topic, 1, RECORDED + 5),
        LogPosition(topic, deployment.partitions, 0),  # no such partition
        LogPosition(topics.events("order"), 0, 10**9),  # even of a topic customers does not read
    ):
        for path in (f"/views/customers/{cid}", "/views/customers"):
            started = time.monotonic()
            r = client.get(f"{path}?consistent_with={position.token()}&wait=30", headers=READER)
            assert fields_of(error_of(r, 422, "validation_failed")) == {"consistent_with"}
            assert time.monotonic() - started < 10  # not the 30 s asked for


def test_a_position_in_the_log_but_not_yet_committed_is_waited_for_not_refused(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    """A command's `201` comes once its transaction is committed, and its records become
    readable (the last stable offset passes them) once the commit markers are written, a moment
    later on a cluster: a read with that position in between waits, as for any position the
    view has not reached; `422` is for positions past what the log holds."""
    from kafka import KafkaProducer

    cid = uid("ryw-uncommitted")
    add_customer(deployment, cid)
    producer = KafkaProducer(
        bootstrap_servers=deployment.kafka(), transactional_id=uid("open"), acks="all"
    )
    try:
        producer.init_transactions()
        producer.begin_transaction()
        sent = producer.send(topics.events("customer"), b"{}", key=cid.encode(), partition=2)
        offset = sent.get(timeout=30).offset
        position = LogPosition(topics.events("customer"), 2, offset).token()
        r = client.get(f"/views/customers/{cid}?consistent_with={position}&wait=1", headers=READER)
        error_of(r, 504, "timeout")
        producer.abort_transaction()
    finally:
        producer.close()


def test_waiting_reads_are_bounded_per_subject_and_process(
    client: FlaskClient, deployment: Settings, topics: Topics, model: ReadModel
) -> None:
    """Past `max_waiters_per_subject` waits under way, a subject's next read is `429` with
    Retry-After at once; other subjects still wait, up to the process's `max_waiters`."""
    topic = topics.events("customer")
    set_progress(deployment, "customers", {f"{topic}:0": 0})
    tok = LogPosition(topic, 0, RECORDED - 1).token()
    per_subject, per_process = model.waiters.max_per_subject, model.waiters.max_all
    headers = {"Authorization": f"Bearer {token('views:read', subject='patient')}"}
    answers: list[int] = []

    def wait_long() -> None:
        r = client.get(f"/views/customers?consistent_with={tok}&wait=20", headers=headers)
        answers.append(r.status_code)

    waiting = [threading.Thread(target=wait_long, daemon=True) for _ in range(per_subject)]
    for t in waiting:
        t.start()
    wait_until(lambda: model.waiters.subjects.get("patient") == per_subject, 20, "the waits")
    r = client.get(f"/views/customers?consistent_with={tok}&wait=20", headers=headers)
    error_of(r, 429, "too_many_requests")
    assert int(r.headers["Retry-After"]) >= 1
    other = {"Authorization": f"Bearer {token('views:read', subject='another')}"}
    r = client.get(f"/views/customers?consistent_with={tok}&wait=0", headers=other)
    error_of(r, 504, "timeout")  # it waited its turn: another subject is not refused
    assert per_subject < per_process
    set_progress(deployment, "customers", {f"{topic}:0": RECORDED})
    for t in waiting:
        t.join(timeout=30)
    assert answers == [200] * per_subject
    assert "patient" not in model.waiters.subjects  # every place given back


def test_a_real_commands_position(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    """The position a command answers with names this deployment's topic; the view waits for
    exactly that offset, and the 504 reports the unapplied event as lag."""
    r = client.post(
        "/commands/register-customer",
        headers=EVERYTHING,
        json={"data": {"name": "Rita", "email": "rita@example.com"}},
    )
    assert r.status_code == 201, r.json
    cid, tok = r.json["aggregate_id"], r.json["position"]
    position = LogPosition.parse(tok)
    assert position.topic == topics.events("customer")
    key = f"{position.topic}:{position.partition}"
    set_progress(deployment, "customers", {key: position.offset - 1} if position.offset else {})

    error = error_of(
        client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=0.5", headers=READER),
        504,
        "timeout",
    )
    assert error["details"][0]["lag"]["events"] >= 1

    # what the projector would do: the row and the progress in one transaction
    with psycopg.connect(deployment.database()) as conn:
        conn.execute(
            "INSERT INTO customers (customer_id, name, email, registered_at, version) "
            "VALUES (%s, 'Rita', 'rita@example.com', now(), 1)",
            (cid,),
        )
        conn.execute(
            "UPDATE projection_progress SET offsets = %s, updated_at = now() "
            "WHERE projection = 'customers'",
            (Jsonb({key: position.offset}),),
        )
    r = client.get(f"/views/customers/{cid}?consistent_with={tok}&wait=5", headers=READER)
    assert r.status_code == 200 and r.json["name"] == "Rita"


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "!!!",
        b64(["t", 0]),
        b64(["t", "0", 1]),
        b64(["t", 0, "1"]),
        b64({"topic": "t", "partition": 0, "offset": 1}),
        b64([1, 0, 1]),
        b64(None),
        b64(["t", 0.5, 1]),
    ],
)
def test_a_garbage_position_is_422(client: FlaskClient, value: str) -> None:
    for path in ("/views/customers/c-1", "/views/customers"):
        r = client.get(f"{path}?consistent_with={quote(value)}&wait=0", headers=READER)
        assert fields_of(error_of(r, 422, "validation_failed")) == {"consistent_with"}


@pytest.mark.parametrize("wait", ["31", "30.5", "-1", "abc", "nan", "inf", ""])
def test_wait_out_of_bounds_is_422(client: FlaskClient, topics: Topics, wait: str) -> None:
    tok = LogPosition(topics.events("customer"), 0, 0).token()
    for path in ("/views/customers/c-1", "/views/customers"):
        r = client.get(f"{path}?consistent_with={tok}&wait={quote(wait)}", headers=READER)
        assert fields_of(error_of(r, 422, "validation_failed")) == {"wait"}


# --- no input yields a 500 -------------------------------------------------------------------

# Known production bugs, reported with patches; strict, so a fix turns these into failures that
# ask for the marker to be removed.

ODD = [
    "/views/customers?limit=1e400",
    "/views/customers?limit=%00",
    "/views/customers?limit=50&limit=abc",
    "/views/customers?cursor=%00",
    "/views/customers?cursor====",
    "/views/customers?cursor=" + "A" * 5000,
    pytest.param("/views/customers?name=%00"),
    "/views/customers?name=%ED%A0%80",  # a lone surrogate, not UTF-8
    "/views/customers?email=" + "x" * 20000,
    "/views/customers?=x",
    "/views/customers?&&&",
    "/views/customers?name",
    pytest.param("/views/customers/%00"),
    "/views/customers/%FF%FE",
    "/views/customers/" + "k" * 5000,
    "/views/customers/a/b/c",
    "/views/customers/",
    "/views/sales_by_hour/b,%00",
    "/views/sales_by_hour/b,99999-01-01",
    "/views/sales_by_hour/b,0001-01-01T00:00:00-23:59",
    "/views/sales_by_hour/b,9999-12-31T23:59:59.999999-23:59",
    pytest.param("/views/sales_by_hour/%00,2024-01-01T00:00:00Z"),
    "/views/sales_by_hour/,",
    pytest.param("/views/sales_by_hour?book_id=%00"),
    "/views/sales_by_hour?cursor=" + b64(["b", "9999-12-31T23:59:59-23:59"]),
    pytest.param("/views/sales_by_hour?cursor=" + b64(["\u0000", "2024-01-01T00:00:00Z"])),
    pytest.param("/views/customers?cursor=" + b64(["\u0000"])),
    "/views/customers?cursor=" + b64([{"a": [1, 2]}]),
    "/views/customers?cursor=" + b64([10**400]),
    "/views/%00",
    "/views/%00/x",
    "/views//x",
    "/views/customers?consistent_with=%00",
    "/views/customers?consistent_with=" + b64(["t", 10**30, 10**30]),
    "/views/customers?consistent_with=" + b64(["\u0000", 0, 0]) + "&wait=0",
    "/views/customers?consistent_with=" + b64(["t", True, False]) + "&wait=0",
    "/views/customers?wait=999",  # without a position, wait is unused
]


@pytest.mark.parametrize("path", ODD)
def test_odd_input_is_never_a_500(client: FlaskClient, path: str) -> None:
    r = client.get(path, headers=READER)
    assert r.status_code < 500, (r.status_code, r.get_data(as_text=True))
    if 300 <= r.status_code < 400:  # werkzeug merges duplicate slashes with a redirect
        assert r.status_code == 308, r.headers
        assert urlsplit(r.headers["Location"]).path == "/views/x", r.headers
        return
    assert r.mimetype == "application/json"
    if r.status_code >= 400:
        assert r.json["error"]["code"] in {"validation_failed", "not_found"}, r.json
    else:
        assert r.status_code == 200


@pytest.mark.parametrize("method", ["post", "put", "delete", "patch"])
def test_views_are_read_only(client: FlaskClient, method: str) -> None:
    call: Callable[..., TestResponse] = getattr(client, method)
    for path in ("/views", "/views/customers", "/views/customers/c-1"):
        r = call(path, headers=EVERYTHING, json={})
        error_of(r, 405, "method_not_allowed")


# --- health and metrics ----------------------------------------------------------------------


@pytest.fixture
def projections_progress(deployment: Settings, topics: Topics) -> Iterator[None]:
    for name, projection in PROJECTIONS.items():
        offsets = {f"{topics.events(t)}:0": 0 for t in projection.topics}
        set_progress(deployment, name, offsets, late_events=3 if name == "sales_by_hour" else 0)
    yield


def test_health_has_a_component_per_projection(
    client: FlaskClient, projections_progress: None
) -> None:
    # The progress just set shows within a round of the background checks.
    health_component(client, "projection:sales_by_hour", lambda c: c["late_events"] == 3)
    r = client.get("/health")
    assert r.status_code in (200, 503) and r.mimetype == "application/json"
    components = r.json["components"]
    for name in PROJECTIONS:
        c = components.get(f"projection:{name}")
        assert c is not None, (name, sorted(components))
        assert c["status"] in ("up", "down")
        assert isinstance(c["lag_events"], int) and c["lag_events"] >= 0
        assert isinstance(c["lag_seconds"], int | float) and c["lag_seconds"] >= 0
        assert isinstance(c["late_events"], int)
    assert components["projection:sales_by_hour"]["late_events"] == 3
    assert components["projection:customers"]["late_events"] == 0
    assert components["projection:books"]["status"] == "up"  # not stale: just updated


def test_metrics_expose_projection_lag_and_late_events(
    client: FlaskClient, projections_progress: None
) -> None:
    health_component(client, "projection:sales_by_hour", lambda c: c["late_events"] == 3)
    r = client.get("/metrics", headers=ADMIN)
    assert r.status_code == 200 and r.mimetype == "text/plain"
    samples = {
        (s.name, s.labels.get("component")): s.value
        for family in text_string_to_metric_families(r.get_data(as_text=True))
        for s in family.samples
    }
    for name in PROJECTIONS:
        component = f"projection:{name}"
        assert samples.get(("logfold_component_lag_events", component), -1) >= 0, component
        assert ("logfold_late_events", component) in samples, component
        assert samples.get(("logfold_component_up", component)) in (0.0, 1.0), component
    assert samples[("logfold_late_events", "projection:sales_by_hour")] == 3
    assert samples[("logfold_late_events", "projection:customers")] == 0


def test_health_counts_unapplied_events_as_projection_lag(
    client: FlaskClient, deployment: Settings, topics: Topics
) -> None:
    """With the progress of `customers` emptied, every customer event in the log is lag."""
    r = client.post(
        "/commands/register-customer",
        headers=EVERYTHING,
        json={"data": {"name": "Lag", "email": "lag@example.com"}},
    )
    assert r.status_code == 201, r.json
    set_progress(deployment, "customers", {})
    ends: dict[str, Any] = {}

    def lagging() -> bool:
        ends.update(client.get("/health").json["components"])
        return int(ends["projection:customers"]["lag_events"]) >= 1

    wait_until(lagging, 15, "customers lag in /health")  # end offsets are cached for 1 s
    assert ends["projection:customers"]["status"] == "up"  # behind, but not stale


# --- row-level access (guarantee 18) ---------------------------------------------------------


def test_a_row_claim_restricts_every_read_of_views_with_that_column(
    client: FlaskClient, deployment: Settings
) -> None:
    tag = uuid.uuid4().hex[:8]
    mine, theirs = f"mine-{tag}", f"theirs-{tag}"
    add_customer(deployment, mine, name=f"Me {tag}")
    add_customer(deployment, theirs, name=f"Them {tag}")
    for n, (customer, status) in enumerate([(mine, "placed"), (mine, "paid"), (theirs, "paid")]):
        add_order(deployment, f"o-{tag}-{n}", customer, status)
    own = {"Authorization": f"Bearer {token('views:read', rows={'customer_id': mine})}"}

    def ids(path: str) -> set[str]:
        r = client.get(path, headers=own)
        assert r.status_code == 200, r.json
        return {row["order_id"] for row in r.json["rows"]}

    everyone = client.get("/views/orders?limit=500", headers=READER).json["rows"]
    assert {r["customer_id"] for r in everyone} >= {mine, theirs}
    assert ids("/views/orders?limit=500") == {f"o-{tag}-0", f"o-{tag}-1"}
    assert ids("/views/orders?status=paid") == {f"o-{tag}-1"}  # a filter narrows it
    assert ids(f"/views/orders?customer_id={mine}") == {f"o-{tag}-0", f"o-{tag}-1"}
    widened = client.get(f"/views/orders?customer_id={theirs}", headers=own)
    assert widened.status_code == 403 and widened.json["error"]["code"] == "forbidden"

    assert client.get(f"/views/orders/o-{tag}-0", headers=own).status_code == 200
    other = client.get(f"/views/orders/o-{tag}-2", headers=own)  # exists, but not theirs
    assert other.status_code == 404 and other.json["error"]["code"] == "not_found"
    assert client.get(f"/views/customers/{mine}", headers=own).json["name"] == f"Me {tag}"
    assert client.get(f"/views/customers/{theirs}", headers=own).status_code == 404
    customers = client.get("/views/customers?limit=500", headers=own).json["rows"]
    assert [c["customer_id"] for c in customers] == [mine]

    books = client.get("/views/books", headers=own)  # no customer_id column: nothing to see
    assert books.status_code == 403 and "customer_id" in books.json["error"]["message"]
    assert client.get("/views/books/dune", headers=own).status_code == 403


def test_a_malformed_row_claim_is_an_invalid_token(client: FlaskClient) -> None:
    import jwt

    from config.settings import JWT_AUDIENCE
    from tests.support import SECRET

    now = int(time.time())
    claims = {"sub": "x", "scope": "views:read", "iss": "logfold", "iat": now, "exp": now + 60}
    claims["aud"] = JWT_AUDIENCE  # a valid token but for its claim
    for rows in ({}, {"customer_id": 7}, ["customer_id"], "c-1"):
        bad = jwt.encode({**claims, "rows": rows}, SECRET, algorithm="HS256")
        r = client.get("/views/orders", headers={"Authorization": f"Bearer {bad}"})
        assert r.status_code == 401, (rows, r.json)
