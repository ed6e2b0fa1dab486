"""Bad input, fuzzed (guarantee 14): requests generated from `/openapi.json` (schemathesis, a
fixed seed, about 2,000 of them, valid and invalid) against the app on real Kafka and
Postgres with a command processor: never a 5xx, every error in the contract's JSON, every
status one the document lists. And hostile websocket messages: never a crash, every error
in the protocol's format."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from werkzeug.serving import make_server

from app import close_app, create_app
from commands.processor import CommandProcessor
from stack.procs import free_port
from stack.settings import Settings
from tests.support import token
from tests.wsclient import WsClient

pytestmark = pytest.mark.integration

REQUESTS = 2000
AUTH = {"Authorization": f"Bearer {token()}"}


@pytest.fixture(scope="module")
def app(deployment: Settings, processor: CommandProcessor) -> Iterator[Flask]:
    # Short waits: generated `wait`s and commands must not make the run minutes long.
    flask_app = create_app(deployment.model_copy(update={"command_timeout_s": 3.0}))
    yield flask_app
    close_app(flask_app)


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
def test_generated_requests_never_get_a_5xx_and_errors_follow_the_contract(app: Flask) -> None:
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
    b"\x00\xff\xfe binary",
    bytes(range(256)),
    "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"),
]


def test_hostile_websocket_messages_get_errors_and_never_crash_the_connection(
    deployment: Settings,
) -> None:
    app = create_app(deployment)
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = WsClient(f"ws://127.0.0.1:{port}/ws", token("views:read"))
    try:
        for message in HOSTILE:
            if isinstance(message, bytes):
                client.ws.send_binary(message)
            else:
                client.ws.send(message)
        client.wait_for(
            lambda: sum(m["type"] == "error" for m in client.messages) >= len(HOSTILE),
            "an error for every hostile message",
        )
        errors = [m for m in client.messages if m["type"] == "error"]
        for error in errors:
            assert set(error) >= {"type", "id", "code", "message"}, error
            assert error["code"] in ("malformed_json", "validation_failed", "not_found"), error
        assert client.close_code is None  # still open, still useful:
        client.subscribe("ok", "books")
        client.wait_for(lambda: bool(client.of("ok", "snapshot")), "a snapshot after all that")
    finally:
        client.close()
        server.shutdown()
        close_app(app)
