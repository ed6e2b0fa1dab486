"""Bad input, fuzzed (guarantee 14): requests generated from `/openapi.json` (schemathesis, a
fixed seed, about 2,000 of them, valid and invalid) against the app on real Kafka and
Postgres with a command processor: never a 5xx, every error in the contract's JSON, every
status one the document lists. And hostile websocket messages: never a crash, every error
in the protocol's format."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
import schemathesis
import sqlalchemy as sa
from flask import Flask
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.formats import get_default_format_strategies

from app import close_app, create_app
from app.views_api import MAX_LIMIT
from commands.messages import LogPosition
from commands.processor import CommandProcessor
from config.settings import Settings, sqlalchemy_url
from config.topics import Topics
from projections.registry import VIEWS
from tests.support import served, token
from tests.wsclient import WsClient

pytestmark = pytest.mark.integration

REQUESTS = 2000
AUTH = {"Authorization": f"Bearer {token()}"}


# Times at the ends of what the layers hold: Python's years 1 and 9999, with offsets that push
# them past UTC's range, and Postgres' own ends (a bigger year or `infinity`) in the rows.
EDGE_TIMES = [
    "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00+05:00",
    "0001-01-01T00:00:00+14:00",
    "0001-01-01T13:59:59-14:00",
    "9999-12-31T23:59:59Z",
    "9999-12-31T23:59:59-05:00",
    "9999-12-31T10:00:01-14:00",
    "9999-12-31T23:59:59.999999+14:00",
    "2026-11-27T12:00:00+14:00",
    "2026-11-27T12:00:00-14:00",
]
EDGE_DAYS = ["0001-01-01", "9999-12-31", "2026-02-29", "2024-02-29"]
ROWS_PER_VIEW = MAX_LIMIT + 25  # every view pages, whatever `limit` a request asks for


def _value(column: sa.Column[Any], i: int) -> Any:
    """The `i`th generated value of `column`, unique per row, times and days at their edges."""
    kind = column.type.python_type
    if kind is datetime:
        early = datetime(1, 1, 1, tzinfo=UTC) + timedelta(minutes=i)
        late = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC) - timedelta(minutes=i)
        return early if i % 2 else late
    if kind is date:
        return date(1, 1, 1) + timedelta(days=i) if i % 2 else date(9999, 12, 31) - timedelta(i)
    if kind is int:
        return i
    if kind is float:
        return i / 1000
    if kind is str:
        return f"{column.name}-{i:05d}"
    return [f"b{i}"]  # JSON


def populate_views(settings: Settings) -> None:
    """Every view's table with more rows than the largest page, written straight to Postgres
    (this is the read side's input; no projector runs in this module)."""
    engine = sa.create_engine(sqlalchemy_url(settings.database()))
    try:
        tables = {view.table.name: view.table for _, view in VIEWS.values()}
        with engine.begin() as conn:
            for table in tables.values():
                rows = [{c.name: _value(c, i) for c in table.columns} for i in range(ROWS_PER_VIEW)]
                conn.execute(table.insert(), rows)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def app(deployment: Settings, processor: CommandProcessor) -> Iterator[Flask]:
    populate_views(deployment)
    # Short waits: generated `wait`s and commands must not make the run minutes long.
    flask_app = create_app(deployment.model_copy(update={"command_timeout_s": 3.0}))
    yield flask_app
    close_app(flask_app)


@pytest.fixture
def edge_times() -> Iterator[None]:
    """Generated `date-time` and `date` strings include the edge values half of the time."""
    defaults = get_default_format_strategies()
    for name, edges in (("date-time", EDGE_TIMES), ("date", EDGE_DAYS)):
        schemathesis.openapi.format(name, st.one_of(st.sampled_from(edges), defaults[name]))
    yield
    for name in ("date-time", "date"):
        schemathesis.openapi.format(name, defaults[name])


def error_problems(status: int, body: bytes, content_type: str) -> str | None:
    """Why an error response is not the contract's `{"error": {code, message, details}}`."""
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"{status} is {content_type}, not JSON"
    error = json.loads(body).get("error")
    if not (
        isinstance(error, dict)
        and isinstance(error.get("code"), str)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("details"), list)
    ):
        return f"{status} body is not the error contract: {body[:200]!r}"
    return None


# schemathesis's own strategies draw from `random`, which Hypothesis warns about (not our code).
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_generated_requests_never_get_a_5xx_and_errors_follow_the_contract(
    app: Flask, edge_times: None
) -> None:
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    # Operations without parameters give few distinct requests: ask a little more of each.
    per_mode = math.ceil(1.25 * REQUESTS / (2 * len(operations)))
    statuses: Counter[int] = Counter()
    problems: list[str] = []

    def probe_of(operation: Any, mode: GenerationMode) -> Any:
        documented = {str(code) for code in operation.definition.raw.get("responses", {})}
        fixed: dict[str, Any] = {}
        if "wait" in operation.query:
            fixed["query"] = {"wait": 0}

        @settings(
            max_examples=per_mode,
            derandomize=True,  # the same requests on every run
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(mode, **fixed))
        def probe(case: Any) -> None:
            response = case.call(headers=AUTH)
            statuses[response.status_code] += 1
            where = f"{case.method} {case.formatted_path} {case.query} {case.body!r:.200}"
            if case.path == "/health":  # its 503 (a component down) is its own document
                return
            if response.status_code >= 500:
                problems.append(f"{response.status_code} for {where}")
            if str(response.status_code) not in documented:
                problems.append(f"undocumented {response.status_code} for {where}")
            content_type = response.headers.get("content-type", [""])[0]
            problem = error_problems(response.status_code, response.content, content_type)
            if problem:
                problems.append(f"{problem} for {where}")

        return probe

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                probe_of(operation, mode)()
            except Unsatisfiable:  # nothing of it can be made invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE, operation.label

    print(f"{sum(statuses.values())} requests: {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:30])
    assert sum(statuses.values()) >= REQUESTS
    assert statuses[201] > 0 and statuses[200] > 0 and statuses[422] > 0  # it reached all sides


HOSTILE: list[str | bytes] = [
    "",
    "null",
    "[]",
    "42",
    '"subscribe"',
    "{",
    '{"op": null}',
    '{"op": 7, "id": []}',
    '{"op": "subscribe"}',
    '{"op": "subscribe", "id": "' + "x" * 5000 + '", "view": "books"}',
    '{"op": "subscribe", "id": "s", "view": "books", "filter": "title"}',
    '{"op": "subscribe", "id": "s", "view": "books", "filter": {"title": {"$ne": 1}}}',
    '{"op": "subscribe", "id": "s", "view": "books", "since": 12}',
    '{"op": "subscribe", "id": "s", "view": "books", "wait": -1, "consistent_with": "x"}',
    '{"op": "unsubscribe", "id": 9}',
    '{"op": "teleport"}',
    "[" * 3000 + "]" * 3000,
    '{"a": ' * 2000 + "1" + "}" * 2000,
    *(  # a time UTC cannot hold, on a key column of timestamps
        json.dumps(
            {"op": "subscribe", "id": at, "view": "sales_by_hour", "filter": {"window_start": at}}
        )
        for at in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00")
    ),
    b"\x00\xff\xfe binary",
    bytes(range(256)),
    "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"),
]


@pytest.fixture
def ws(deployment: Settings) -> Iterator[WsClient]:
    """A `views:read` websocket client of an API served for this test."""
    with served(deployment) as (url, _):
        client = WsClient(url, token("views:read"))
        yield client
        client.close()


def test_hostile_websocket_messages_get_errors_and_never_crash_the_connection(
    ws: WsClient,
) -> None:
    for message in HOSTILE:
        if isinstance(message, bytes):
            ws.ws.send_binary(message)
        else:
            ws.ws.send(message)
    ws.wait_for(
        lambda: sum(m["type"] == "error" for m in ws.messages) >= len(HOSTILE),
        "an error for every hostile message",
    )
    errors = [m for m in ws.messages if m["type"] == "error"]
    for error in errors:
        assert set(error) >= {"type", "id", "code", "message"}, error
        assert error["code"] in ("malformed_json", "validation_failed", "not_found"), error
    assert ws.close_code is None  # still open, still useful:
    ws.subscribe("ok", "books")
    ws.wait_for(lambda: bool(ws.of("ok", "snapshot")), "a snapshot after all that")


class LostAnswer:
    """A Kafka client whose `end_offsets` fails as kafka-python's does when the broker closed
    the connection its request was on."""

    def __init__(self, **_: Any) -> None:
        pass

    def end_offsets(self, partitions: list[Any]) -> dict[Any, int]:
        raise KeyError(partitions[0])

    def close(self) -> None:
        pass


def test_a_kafka_failure_in_a_consistency_wait_is_an_error_and_the_socket_stays(
    ws: WsClient, deployment: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.read_model.KafkaConsumer", LostAnswer)
    # The wait first looks where the log ends: in Kafka.
    far = LogPosition(Topics(deployment.topic_prefix).events("order"), 0, 10**9).token()
    ws.send({"op": "subscribe", "id": "w", "view": "orders", "consistent_with": far, "wait": 0})
    ws.wait_for(lambda: bool(ws.of("w", "error")), "an error for the wait")
    assert ws.of("w", "error")[0]["code"] == "unavailable"
    monkeypatch.undo()
    ws.subscribe("ok", "books")
    ws.wait_for(lambda: bool(ws.of("ok", "snapshot")), "a snapshot afterwards")
    assert ws.close_code is None
