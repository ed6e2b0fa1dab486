"""What the API tells whom: tokens must name this API and live no longer than it accepts; a
`503` says what to do, never what the broker said; a failed projection's text and lost ranges
reach `admin` callers only; an X-Correlation-Id is checked before it is kept in events for ever.
The app is wired with fakes (no Kafka, no Postgres): these are the routes' own decisions."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jwt
import pytest
from click.testing import CliRunner
from flask import Flask
from flask.testing import FlaskClient

from app import close_app, create_app
from app.auth import issue_token
from commands import bus as command_bus
from commands.messages import LogPosition
from config.settings import JWT_AUDIENCE, Settings
from stack import cli
from streams import ingest

SECRET = "unit-secret-Xq9Lw2Rt7Yp4Kz8Nb3Vc6Hm1Jd5Gf0"
# What a broker's client says when it fails: hosts, ports, internals, none for the client.
RAW = "KafkaConnectionError: 10.7.3.21:9092 <connecting> [IPv4 ('10.7.3.21', 9092)]"
FAILURE = "ValueError: bad email 'ann@example.com' for customer c-42"


class FakeBus:
    def __init__(self) -> None:
        self.submitted: list[Any] = []
        self.error: Exception | None = None

    def new_message(self, **fields: Any) -> Any:
        return SimpleNamespace(**fields)

    def submit(self, msg: Any) -> Any:
        if self.error is not None:
            raise self.error
        self.submitted.append(msg)
        return SimpleNamespace(body={"ok": True}, status=201, replay=False)

    def close(self) -> None:
        pass


class FakeIngestion:
    error: Exception | None = None

    def append(self, stream: Any, records: Any) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        pass


class FakeReadModel:
    """One failed projection that also lost records; views never reach a position."""

    def lag(self) -> dict[str, dict[str, Any]]:
        return {
            "customers": {
                "events": 3,
                "seconds": 1.5,
                "late_events": 0,
                "generation": 0,
                "lost_offsets": 2,
                "data_loss": [{"partition": "events.customer:0", "from_offset": 2, "to_offset": 3}],
                "failed": {"error": FAILURE, "offsets": {"events.customer:0": 7}, "at": "now"},
            }
        }

    def wait_for(self, fold: Any, position: Any, timeout: float, *rest: Any) -> bool:
        return False

    def close(self) -> None:
        pass


class Stoppable:
    def stop(self) -> None:
        pass


@pytest.fixture
def fakes() -> SimpleNamespace:
    return SimpleNamespace(bus=FakeBus(), ingestion=FakeIngestion(), read_model=FakeReadModel())


@pytest.fixture
def app(fakes: SimpleNamespace) -> Iterator[Flask]:
    settings = Settings(jwt_secret=SECRET, jwt_max_ttl_s=3600)
    app = create_app(
        settings,
        bus=fakes.bus,
        ingestion=fakes.ingestion,
        read_model=fakes.read_model,
        health=Stoppable(),
        hub=Stoppable(),
    )
    yield app
    close_app(app)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def bearer(
    *scopes: str,
    ttl: int = 600,
    rows: dict[str, str] | None = None,
    claims: dict[str, Any] | None = None,
) -> dict[str, str]:
    """A token from `issue_token`, or with `claims` one made by hand (no `aud` unless given)."""
    if claims is None:
        token = issue_token(SECRET, "t", scopes, ttl, rows)
    else:
        now = int(time.time())
        base = {"sub": "t", "scope": " ".join(scopes), "iss": "logfold", "iat": now}
        token = jwt.encode({**base, "exp": now + ttl, **claims}, SECRET, algorithm="HS256")
    return {"Authorization": f"Bearer {token}"}


def register(client: FlaskClient, headers: dict[str, str]) -> Any:
    body = {"data": {"name": "Ann", "email": "ann@example.com"}}
    return client.post("/commands/register-customer", json=body, headers=headers)


# --- tokens ----------------------------------------------------------------------------------


def test_a_token_names_this_api_as_its_audience(client: FlaskClient) -> None:
    assert register(client, bearer("commands:write")).status_code == 201
    for claims, hint in (
        ({}, 'missing the "aud" claim'),
        ({"aud": "another-api"}, "Audience"),
        ({"aud": ["another-api"]}, "Audience"),
    ):
        r = register(client, bearer("commands:write", claims=claims))
        assert r.status_code == 401, (claims, r.json)
        assert r.json["error"]["code"] == "unauthorized"
        assert hint in r.json["error"]["message"], (claims, r.json)


def test_the_audience_is_a_setting(fakes: SimpleNamespace) -> None:
    app = create_app(
        Settings(jwt_secret=SECRET, jwt_audience="orders-api"),
        **vars(fakes),
        health=Stoppable(),
        hub=Stoppable(),
    )
    try:
        client = app.test_client()
        assert register(client, bearer("commands:write")).status_code == 401  # logfold-api
        own = bearer("commands:write", claims={"aud": "orders-api"})
        assert register(client, own).status_code == 201
    finally:
        close_app(app)


def test_a_token_living_longer_than_the_api_accepts_is_401_saying_so(
    client: FlaskClient, fakes: SimpleNamespace
) -> None:
    assert register(client, bearer("commands:write", ttl=3600)).status_code == 201
    r = register(client, bearer("commands:write", ttl=3601))
    assert r.status_code == 401, r.json
    message = r.json["error"]["message"]
    assert "lifetime is too long" in message and "3601 s" in message and "3600 s" in message
    assert "LOGFOLD_JWT_MAX_TTL_S" in message
    # Without `iat` the lifetime is unknown: refused too.
    now = int(time.time())
    token = jwt.encode(
        {"sub": "t", "scope": "views:read", "iss": "logfold", "aud": JWT_AUDIENCE, "exp": now + 60},
        SECRET,
        algorithm="HS256",
    )
    r = client.get("/views", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401 and '"iat"' in r.json["error"]["message"], r.json
    assert len(fakes.bus.submitted) == 1


def test_logfold_token_issues_for_the_audience_and_refuses_a_lifetime_the_api_would(
    tmp_path: Path,
) -> None:
    env = {
        "LOGFOLD_JWT_SECRET": SECRET,
        "LOGFOLD_HOME": str(tmp_path),  # no local stack here to take settings from
        "LOGFOLD_JWT_AUDIENCE": "orders-api",
        "LOGFOLD_JWT_MAX_TTL_S": "7200",
    }
    runner = CliRunner()
    done = runner.invoke(cli.main, ["token", "--scope", "views:read"], env=env)
    assert done.exit_code == 0, done.output
    claims = jwt.decode(done.output.strip(), SECRET, ["HS256"], audience="orders-api")
    assert claims["exp"] - claims["iat"] == 7200  # the longest the API accepts, by default
    assert runner.invoke(cli.main, ["token", "--ttl", "7200"], env=env).exit_code == 0
    refused = runner.invoke(cli.main, ["token", "--ttl", "7201"], env=env)
    assert refused.exit_code == 2 and "eyJ" not in refused.output
    assert "longer than the API accepts (7200 s, LOGFOLD_JWT_MAX_TTL_S)" in refused.output


# --- 503 and 504 without the broker's words --------------------------------------------------


def test_a_command_503_says_what_to_do_and_logs_what_kafka_said(
    client: FlaskClient, fakes: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    fakes.bus.error = command_bus.Unavailable(RAW)
    with caplog.at_level(logging.WARNING):
        r = register(client, bearer("commands:write"))
    assert r.status_code == 503 and r.headers["Retry-After"], r.json
    error = r.json["error"]
    assert error["code"] == "unavailable" and "Retry" in error["message"]
    assert "10.7.3.21" not in r.get_data(as_text=True) and "KafkaConnectionError" not in str(error)
    assert "10.7.3.21:9092" in caplog.text  # for the operator


@pytest.mark.parametrize(
    ("error", "status"), [(ingest.Unavailable(RAW), 503), (ingest.Unknown(RAW), 504)]
)
def test_a_stream_503_or_504_says_what_to_do_and_logs_what_kafka_said(
    client: FlaskClient,
    fakes: SimpleNamespace,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    status: int,
) -> None:
    fakes.ingestion.error = error
    record = {
        "id": "pv-1",
        "occurred_at": "2026-11-23T10:00:00Z",
        "data": {"customer_id": "c-1", "book_id": "b-1"},
    }
    with caplog.at_level(logging.WARNING):
        r = client.post(
            "/streams/page_views/records",
            json={"records": [record]},
            headers=bearer("streams:write"),
        )
    assert r.status_code == status, r.json
    assert "Retry the same request" in r.json["error"]["message"]
    assert "10.7.3.21" not in r.get_data(as_text=True)
    assert "10.7.3.21:9092" in caplog.text


# --- a projection's failure: admin callers only ----------------------------------------------


def test_views_show_a_failure_and_lost_ranges_to_admin_callers_only(client: FlaskClient) -> None:
    customer = bearer("views:read", rows={"customer_id": "c-42"})
    for headers in (customer, bearer("views:read")):
        r = client.get("/views", headers=headers)
        assert r.status_code == 200, r.json
        lag = next(v["lag"] for v in r.json["views"] if v["name"] == "customers")
        assert lag["failed"] == {"offsets": {"events.customer:0": 7}, "at": "now"}
        assert lag["lost_offsets"] == 2 and "data_loss" not in lag
        assert FAILURE not in r.get_data(as_text=True)
    admin = client.get("/views", headers=bearer("views:read", "admin")).json
    lag = next(v["lag"] for v in admin["views"] if v["name"] == "customers")
    assert lag["failed"]["error"] == FAILURE and lag["data_loss"][0]["from_offset"] == 2


def test_a_504_shows_the_lag_without_the_failure_to_non_admin_callers(client: FlaskClient) -> None:
    position = LogPosition("events.customer", 0, 9).token()
    url = f"/views/customers?consistent_with={position}&wait=0"
    r = client.get(url, headers=bearer("views:read"))
    assert r.status_code == 504, r.json
    [detail] = r.json["error"]["details"]
    assert detail["lag"]["events"] == 3 and "error" not in detail["lag"]["failed"]
    assert FAILURE not in r.get_data(as_text=True) and "data_loss" not in detail["lag"]
    admin = client.get(url, headers=bearer("views:read", "admin"))
    assert admin.json["error"]["details"][0]["lag"]["failed"]["error"] == FAILURE


# --- X-Correlation-Id ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["x" * 129, "has space", "tab\there", "é-accent", "nul\x00", "\x7f"],
    ids=["too-long", "space", "tab", "non-ascii", "nul", "del"],
)
def test_a_bad_correlation_id_is_422_and_nothing_is_sent(
    client: FlaskClient, fakes: SimpleNamespace, value: str
) -> None:
    headers = {**bearer("commands:write"), "X-Correlation-Id": value}
    r = register(client, headers)
    assert r.status_code == 422, r.json
    [detail] = r.json["error"]["details"]
    assert detail["field"] == "X-Correlation-Id" and "128" in detail["problem"]
    assert fakes.bus.submitted == []


def test_a_good_correlation_id_is_kept(client: FlaskClient, fakes: SimpleNamespace) -> None:
    value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for sent in (value, "c" * 128):
        headers = {**bearer("commands:write"), "X-Correlation-Id": sent}
        assert register(client, headers).status_code == 201
        assert fakes.bus.submitted[-1].correlation_id == sent
    assert register(client, bearer("commands:write")).status_code == 201
    assert len(fakes.bus.submitted[-1].correlation_id) == 36  # none: a new one (a UUID)
