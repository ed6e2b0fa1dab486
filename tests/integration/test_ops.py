"""Operational endpoints: the OpenAPI document and its human view, /health and /metrics."""

from __future__ import annotations

import uuid
from typing import Any

import jsonschema
import pytest
from flask.testing import FlaskClient
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families

from app import close_app, create_app
from commands.registry import COMMANDS
from config.settings import Settings
from stack.procs import wait_until
from tests.support import new_deployment, token

ADMIN = {"Authorization": f"Bearer {token('admin')}"}
WRITER = {"Authorization": f"Bearer {token('commands:write')}"}

EXAMPLES: dict[str, dict[str, Any]] = {
    "register-customer": {"name": "Ann", "email": "ann@example.com"},
    "rename-customer": {"name": "Bea"},
    "change-customer-email": {"email": "bea@example.com"},
    "erase-customer": {},
    "add-book": {"title": "Emma", "author": "Austen", "price_cents": 999, "royalty_rate": 0.1},
    "reprice-book": {"price_cents": 1099},
    "place-order": {"customer_id": "c-1", "lines": [{"book_id": "b-1", "quantity": 2}]},
    "pay-order": {"amount_cents": 1998},
    "ship-order": {},
    "cancel-order": {"reason": "changed my mind"},
}


@pytest.fixture(scope="module")
def spec(client: FlaskClient) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200 and r.mimetype == "application/json"
    doc: dict[str, Any] = r.get_json()
    return doc


def body_schema(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The documented request body of a command, with the document's components to resolve
    its `#/components/...` references."""
    post = spec["paths"][f"/commands/{name}"]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    return {**schema, "components": spec["components"]}


def documented_valid(spec: dict[str, Any], name: str, body: Any) -> bool:
    validator = jsonschema.Draft202012Validator(
        body_schema(spec, name), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    return validator.is_valid(body)


# --- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_json_is_a_valid_openapi_document_without_a_token(spec: dict[str, Any]) -> None:
    validate(spec)
    assert spec["openapi"].startswith("3.")
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_every_command_is_documented_with_its_data_schema(spec: dict[str, Any]) -> None:
    assert set(EXAMPLES) == set(COMMANDS), "give every command an example here"
    documented = {p.removeprefix("/commands/") for p in spec["paths"] if p.startswith("/commands/")}
    assert documented == set(COMMANDS)
    for name, command in COMMANDS.items():
        post = spec["paths"][f"/commands/{name}"]["post"]
        assert post["requestBody"]["required"] is True
        assert post["security"] == [{"bearer": [command.command_type.scope]}]
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        ref = schema["properties"]["data"]["$ref"]
        assert ref == f"#/components/schemas/{command.schema.__name__}"
        data = spec["components"]["schemas"][command.schema.__name__]
        model = command.schema
        assert set(data["properties"]) == set(model.model_fields), name
        assert set(data.get("required", [])) == {
            f for f, info in model.model_fields.items() if info.is_required()
        }, name
        assert data["additionalProperties"] is False, name
        want = model.model_json_schema(ref_template="#/components/schemas/{model}")
        want.pop("$defs", None)
        assert data == want, name
        statuses = {"201", "200", "400", "401", "403", "404", "409", "410", "413", "415", "422"}
        assert statuses | {"503", "504"} <= set(post["responses"]), name


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_documented_body_accepts_and_rejects_what_the_model_does(
    spec: dict[str, Any], name: str
) -> None:
    model = COMMANDS[name].schema
    example = EXAMPLES[name]
    model.model_validate(example)
    assert documented_valid(spec, name, {"aggregate_id": "a-1", "data": example})
    assert documented_valid(
        spec, name, {"aggregate_id": "a-1", "expected_version": 3, "data": example}
    )
    assert not documented_valid(spec, name, {"aggregate_id": "a-1", "data": {**example, "x": 1}})
    assert not documented_valid(spec, name, {"aggregate_id": "a 1", "data": example})
    assert not documented_valid(
        spec, name, {"aggregate_id": "a-1", "expected_version": -1, "data": example}
    )
    assert not documented_valid(spec, name, {"aggregate_id": "a-1", "data": example, "y": 2})
    for field in (f for f, info in model.model_fields.items() if info.is_required()):
        missing = {k: v for k, v in example.items() if k != field}
        assert not documented_valid(spec, name, {"aggregate_id": "a-1", "data": missing}), field


@pytest.mark.parametrize("name", [n for n, c in COMMANDS.items() if not c.creates])
def test_the_document_requires_aggregate_id_where_the_api_does(
    client: FlaskClient, spec: dict[str, Any], name: str
) -> None:
    body = {"data": EXAMPLES[name]}
    scope = COMMANDS[name].command_type.scope  # `erase-customer`: admin
    r = client.post(
        f"/commands/{name}", json=body, headers={"Authorization": f"Bearer {token(scope)}"}
    )
    assert spec["paths"][f"/commands/{name}"]["post"]["security"] == [{"bearer": [scope]}]
    assert r.status_code == 422
    assert {"field": "aggregate_id", "problem": f"required for {name}"} in r.json["error"][
        "details"
    ]
    accepted = documented_valid(spec, name, body)
    assert not accepted, f"/openapi.json accepts a {name} without aggregate_id; the API refuses it"


def test_docs_page_loads_swagger_ui_from_its_own_static_files(client: FlaskClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200 and r.mimetype == "text/html"
    page = r.get_data(as_text=True)
    assert '<script src="/docs/static/swagger-ui-bundle.js">' in page
    assert 'href="/docs/static/swagger-ui.css"' in page
    assert '"/openapi.json"' in page and 'id="swagger-ui"' in page
    for asset, mimetype in (
        ("swagger-ui-bundle.js", "text/javascript"),
        ("swagger-ui.css", "text/css"),
    ):
        static = client.get(f"/docs/static/{asset}")
        try:
            assert static.status_code == 200 and static.mimetype == mimetype
            assert len(static.get_data()) > 10_000
        finally:
            static.close()
    bundle = client.get("/docs/static/swagger-ui-bundle.js")
    try:
        assert b"SwaggerUIBundle" in bundle.get_data()
    finally:
        bundle.close()


@pytest.mark.parametrize(
    "path", ["/docs/static/no-such-file.js", "/docs/static/../openapi.py", "/docs/static/%2e%2e/x"]
)
def test_docs_static_serves_nothing_else(client: FlaskClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404 and r.mimetype == "application/json"
    assert r.json["error"]["code"] == "not_found"


# --- /health ---------------------------------------------------------------------------------


def test_health_is_up_with_every_component_and_needs_no_token(client: FlaskClient) -> None:
    def up() -> bool:
        return client.get("/health").status_code == 200

    wait_until(up, 60, "/health to report 200 (the processor joins its group)")
    r = client.get("/health")
    assert r.status_code == 200 and r.mimetype == "application/json"
    body = r.json
    assert body["status"] == "up"
    components = body["components"]
    assert {"kafka", "postgres", "command_processing"} <= set(components)
    assert all(c["status"] == "up" for c in components.values()), components
    assert components["kafka"]["brokers"] >= 1
    processing = components["command_processing"]
    assert processing["processors"] >= 1
    assert isinstance(processing["lag_events"], int) and processing["lag_events"] >= 0
    assert "Retry-After" not in r.headers


def test_health_is_503_when_no_processor_serves_the_deployment(base_settings: Settings) -> None:
    settings = new_deployment(base_settings)
    app = create_app(settings)
    try:
        r = app.test_client().get("/health")
        assert r.status_code == 503 and r.mimetype == "application/json"
        assert r.headers["Retry-After"] == str(settings.retry_after_s)
        body = r.json
        assert body["status"] == "down"
        assert body["components"]["kafka"]["status"] == "up"
        assert body["components"]["postgres"]["status"] == "up"
        processing = body["components"]["command_processing"]
        assert processing.pop("age_seconds") >= 0  # when it was checked, in the background
        assert processing == {"status": "down", "processors": 0, "lag_events": 0}
    finally:
        close_app(app)


# --- /metrics --------------------------------------------------------------------------------


def samples(client: FlaskClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = client.get("/metrics", headers=ADMIN)
    assert r.status_code == 200 and r.mimetype == "text/plain"
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.get_data(as_text=True))
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer nonsense"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token('admin', ttl=-5)}"}, 401, "unauthorized"),
        (WRITER, 403, "forbidden"),
        ({"Authorization": f"Bearer {token('views:read')}"}, 403, "forbidden"),
    ],
    ids=["no-token", "garbage", "expired", "commands-write", "views-read"],
)
def test_metrics_needs_the_admin_scope(
    client: FlaskClient, headers: dict[str, str], status: int, code: str
) -> None:
    r = client.get("/metrics", headers=headers)
    assert r.status_code == status and r.mimetype == "application/json"
    assert r.json["error"]["code"] == code
    assert b"logfold_commands_total" not in r.get_data()


def test_metrics_count_commands_by_name_and_status(client: FlaskClient) -> None:
    def count(command: str, status: str) -> float:
        key = ("logfold_commands_total", frozenset({("command", command), ("status", status)}))
        return samples(client).get(key, 0.0)

    before_201 = count("register-customer", "201")
    before_404 = count("rename-customer", "404")
    r = client.post(
        "/commands/register-customer",
        json={"data": {"name": "Mo", "email": "mo@example.com"}},
        headers=WRITER,
    )
    assert r.status_code == 201, r.json
    missing = {"aggregate_id": f"nobody-{uuid.uuid4().hex[:8]}", "data": {"name": "X"}}
    assert client.post("/commands/rename-customer", json=missing, headers=WRITER).status_code == 404
    assert count("register-customer", "201") == before_201 + 1
    assert count("rename-customer", "404") == before_404 + 1
    latency = samples(client)
    key = ("logfold_command_seconds_count", frozenset({("command", "register-customer")}))
    assert latency[key] >= 1


def test_metrics_show_component_health_after_a_check(client: FlaskClient) -> None:
    wait_until(lambda: client.get("/health").status_code == 200, 60, "/health to report 200")
    values = samples(client)
    for component in ("kafka", "postgres", "command_processing"):
        assert values[("logfold_component_up", frozenset({("component", component)}))] == 1.0
    lag = ("logfold_component_lag_events", frozenset({("component", "command_processing")}))
    assert values[lag] >= 0


def test_erasing_a_customer_needs_the_admin_scope(client: FlaskClient) -> None:
    r = client.post(
        "/commands/erase-customer", json={"aggregate_id": "c-1", "data": {}}, headers=WRITER
    )
    assert r.status_code == 403 and "'admin'" in r.json["error"]["message"]
