"""Webhooks end to end on real Kafka, Postgres and CDC: the API registers endpoints (in this
process), a dispatcher delivers (in a thread of this process, as `logfold webhooks` runs it) to
a real HTTP receiver on a free port.

Changes are plain SQL writes into `customers` (CDC does not care who writes a table): rows get
a `version` bumped by one on each update, so the versions a receiver got for a key show every
gap, duplicate and reordering."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from kafka import KafkaProducer

from app import close_app, create_app
from cdc.capture import Capture
from cdc.changes import WalPosition
from config.settings import Settings
from config.topics import Topics
from stack.procs import wait_until
from tests.changes import Writer, insert_customers, slot_ready, table_versions
from tests.hooks import Receiver, verified, versions_by_key
from tests.support import new_deployment, token
from webhooks.dispatcher import Dispatcher

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {token('admin')}"}
# Retries within tens of milliseconds, endpoints picked up within half a second.
FAST: dict[str, Any] = {
    "webhook_allow_private": True,
    "webhook_backoff_base_s": 0.05,
    "webhook_backoff_cap_s": 0.2,
    "webhook_poll_s": 0.5,
    "webhook_timeout_s": 30.0,
}
WAIT_S = 30


@pytest.fixture(scope="module")
def deployment(base_settings: Settings) -> Settings:
    return new_deployment(base_settings, **FAST)


@pytest.fixture(scope="module")
def api(deployment: Settings, capture: Capture) -> Iterator[FlaskClient]:
    wait_until(lambda: slot_ready(deployment), WAIT_S, "CDC's first snapshot")
    app = create_app(deployment)
    yield app.test_client()
    close_app(app)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


Dispatch = Callable[..., Dispatcher]


@pytest.fixture
def dispatch(deployment: Settings) -> Iterator[Dispatch]:
    """Start a dispatcher with settings overrides; at the end, stop it and delete the test's
    endpoints (so the next test's dispatcher does not deliver them)."""
    running: list[tuple[Dispatcher, threading.Thread]] = []

    def start(**overrides: Any) -> Dispatcher:
        dispatcher = Dispatcher(deployment.model_copy(update=overrides))
        thread = threading.Thread(target=dispatcher.run, name="dispatcher", daemon=True)
        thread.start()
        running.append((dispatcher, thread))
        return dispatcher

    yield start
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute("DELETE FROM webhook_endpoints")
    for dispatcher, thread in running:
        dispatcher.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the dispatcher did not stop"


def _keys(n: int) -> tuple[list[str], str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)], f"group-{tag}"


def register(api: FlaskClient, url: str, group: str, **extra: Any) -> dict[str, Any]:
    answer = api.post(
        "/webhooks",
        json={"url": url, "view": "customers", "filter": {"name": group}, **extra},
        headers=ADMIN,
    )
    assert answer.status_code == 201, answer.get_json()
    body: dict[str, Any] = answer.get_json()
    return body


def endpoint(api: FlaskClient, endpoint_id: str) -> dict[str, Any]:
    answer = api.get(f"/webhooks/{endpoint_id}", headers=ADMIN)
    assert answer.status_code == 200, answer.get_json()
    body: dict[str, Any] = answer.get_json()
    return body


def dead_letters(api: FlaskClient, endpoint_id: str, status: str) -> list[dict[str, Any]]:
    answer = api.get(f"/webhooks/{endpoint_id}/deliveries?status={status}", headers=ADMIN)
    assert answer.status_code == 200, answer.get_json()
    found: list[dict[str, Any]] = answer.get_json()["deliveries"]
    return found


def everything(final: dict[str, int]) -> dict[str, list[int]]:
    """What a receiver holds once it got every version of each key, in order, once."""
    return {k: list(range(v + 1)) for k, v in final.items()}


def test_every_change_arrives_signed_once_and_in_order_per_key(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch()
    keys, group = _keys(3)
    hook = register(api, receiver.url("/ordered"), group)
    assert hook["secret"].startswith("whsec_") and hook["status"] == "active"
    insert_customers(deployment, keys, group)
    Writer(deployment, keys, total=45).run()
    want = everything(table_versions(deployment, keys))
    got = lambda: versions_by_key(receiver.acknowledged("/ordered"))  # noqa: E731
    wait_until(lambda: got() == want, WAIT_S, "every change of every key")
    attempts = receiver.of("/ordered")
    payloads = verified(attempts, hook["secret"])  # the Standard Webhooks library's verifier
    kinds = {(p["type"], p["view"], p["op"]) for p in payloads}
    assert kinds == {("change", "customers", "upsert")}
    positions = [WalPosition.parse(p["position"]) for p in payloads]
    assert positions == sorted(set(positions))  # one total order, no duplicate
    assert len({a.id for a in attempts}) == len(attempts) == 48
    assert all(a.id.startswith(f"msg_{hook['id']}_") for a in attempts)
    assert endpoint(api, hook["id"])["cursor"] > hook["cursor"]


def test_a_failing_endpoint_gets_the_same_delivery_again_then_everything_in_order(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch()
    receiver.behaviours["/flaky"] = lambda n: 500 if n < 6 else 204
    keys, group = _keys(2)
    hook = register(api, receiver.url("/flaky"), group)
    insert_customers(deployment, keys, group)
    Writer(deployment, keys, total=10).run()
    want = everything(table_versions(deployment, keys))
    got = lambda: versions_by_key(receiver.acknowledged("/flaky"))  # noqa: E731
    wait_until(lambda: got() == want, WAIT_S, "every change after the failures")
    attempts = receiver.of("/flaky")
    verified(attempts, hook["secret"])  # each attempt signed with its own timestamp
    assert [a.status for a in attempts[:7]] == [500] * 6 + [204]
    assert len({a.id for a in attempts[:7]}) == 1  # one delivery, retried under its id
    assert len(attempts) == 6 + 12
    shown = endpoint(api, hook["id"])
    assert shown["failing_since"] is None and shown["dead_letters"] == 0


def test_what_is_not_acknowledged_within_the_retry_window_is_a_dead_letter_to_replay(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch(webhook_retry_window_s=1.0)
    up = threading.Event()
    receiver.behaviours["/down"] = lambda n: 200 if up.is_set() else 503
    keys, group = _keys(3)
    hook = register(api, receiver.url("/down"), group)
    insert_customers(deployment, keys, group)
    wait_until(lambda: len(dead_letters(api, hook["id"], "failed")) == 3, WAIT_S, "3 dead letters")
    letters = dead_letters(api, hook["id"], "failed")
    assert [d["key"]["customer_id"] for d in letters] == keys  # in changelog order
    assert all(d["attempts"] >= 2 and d["last_error"] == "HTTP 503" for d in letters)
    sent = {a.id: a.body.decode() for a in receiver.of("/down")}
    assert all(sent[d["id"]] == d["body"] for d in letters)  # kept as it was signed and sent
    shown = endpoint(api, hook["id"])
    assert shown["status"] == "active" and shown["dead_letters"] == 3
    assert receiver.acknowledged("/down") == []

    up.set()
    answer = api.post(f"/webhooks/{hook['id']}/deliveries/replay", headers=ADMIN)
    assert answer.status_code == 202 and answer.get_json()["replaying"] == 3
    wait_until(lambda: len(dead_letters(api, hook["id"], "delivered")) == 3, WAIT_S, "the replays")
    replayed = receiver.acknowledged("/down")
    assert [a.id for a in replayed] == [d["id"] for d in letters]  # same ids, oldest first
    verified(replayed, hook["secret"])
    assert dead_letters(api, hook["id"], "failed") == []
    # and the stream goes on past them
    Writer(deployment, keys[:1], total=1).run()
    wait_until(lambda: len(receiver.acknowledged("/down")) == 4, WAIT_S, "the next change")


def test_a_slow_endpoint_does_not_delay_another(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch()
    release = threading.Event()
    receiver.behaviours["/slow"] = lambda n: 200 if release.wait(WAIT_S) else 500
    keys, group = _keys(2)
    slow = register(api, receiver.url("/slow"), group)
    register(api, receiver.url("/fast"), group)
    insert_customers(deployment, keys, group)
    Writer(deployment, keys, total=20).run()
    want = everything(table_versions(deployment, keys))
    fast = lambda: versions_by_key(receiver.acknowledged("/fast"))  # noqa: E731
    wait_until(lambda: fast() == want, WAIT_S, "the fast endpoint's changes")
    assert receiver.of("/slow") == [] and receiver.pending["/slow"] == 1  # one, held
    release.set()
    slow_got = lambda: versions_by_key(receiver.acknowledged("/slow"))  # noqa: E731
    wait_until(lambda: slow_got() == want, WAIT_S, "the slow endpoint's changes")
    assert endpoint(api, slow["id"])["dead_letters"] == 0


def test_a_paused_endpoint_gets_nothing_until_resumed_then_everything_in_order(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    """A second endpoint on the same rows is the witness that the changes were delivered
    while the first was paused."""
    dispatch()
    keys, group = _keys(2)
    paused = register(api, receiver.url("/paused"), group)
    register(api, receiver.url("/witness-1"), group)
    insert_customers(deployment, keys, group)
    wait_until(lambda: len(receiver.acknowledged("/paused")) == 2, WAIT_S, "the inserts")
    answer = api.patch(f"/webhooks/{paused['id']}", json={"status": "paused"}, headers=ADMIN)
    assert answer.status_code == 200 and answer.get_json()["status"] == "paused"
    Writer(deployment, keys, total=6).run()
    wait_until(lambda: len(receiver.acknowledged("/witness-1")) == 8, WAIT_S, "the witness")
    assert len(receiver.of("/paused")) == 2

    answer = api.patch(f"/webhooks/{paused['id']}", json={"status": "active"}, headers=ADMIN)
    assert answer.status_code == 200 and answer.get_json()["status"] == "active"
    want = everything(table_versions(deployment, keys))
    got = lambda: versions_by_key(receiver.acknowledged("/paused"))  # noqa: E731
    wait_until(lambda: got() == want, WAIT_S, "the changes made while paused")


def test_a_deleted_endpoint_gets_nothing_more(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch()
    keys, group = _keys(1)
    gone = register(api, receiver.url("/deleted"), group)
    register(api, receiver.url("/witness-2"), group)
    insert_customers(deployment, keys, group)
    wait_until(lambda: len(receiver.acknowledged("/deleted")) == 1, WAIT_S, "the insert")
    assert api.delete(f"/webhooks/{gone['id']}", headers=ADMIN).status_code == 204
    assert api.get(f"/webhooks/{gone['id']}", headers=ADMIN).status_code == 404
    Writer(deployment, keys, total=5).run()
    wait_until(lambda: len(receiver.acknowledged("/witness-2")) == 6, WAIT_S, "the witness")
    assert len(receiver.of("/deleted")) == 1
    listed = api.get("/webhooks", headers=ADMIN).get_json()["webhooks"]
    assert gone["id"] not in {w["id"] for w in listed}


def test_an_endpoint_failing_for_too_long_is_paused_with_a_reason_and_resumes_at_its_cursor(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch(webhook_pause_after_s=1.0)
    healthy = threading.Event()
    receiver.behaviours["/dying"] = lambda n: 200 if healthy.is_set() else 500
    keys, group = _keys(2)
    hook = register(api, receiver.url("/dying"), group)
    insert_customers(deployment, keys, group)
    wait_until(lambda: endpoint(api, hook["id"])["status"] == "paused", WAIT_S, "the pause")
    shown = endpoint(api, hook["id"])
    assert "failing for" in shown["paused_reason"] and "HTTP 500" in shown["paused_reason"]
    assert shown["dead_letters"] == 0 and shown["last_error"] == "HTTP 500"
    tried = len(receiver.of("/dying"))
    assert tried >= 2 and {a.id for a in receiver.of("/dying")} == {receiver.of("/dying")[0].id}

    healthy.set()
    answer = api.patch(f"/webhooks/{hook['id']}", json={"status": "active"}, headers=ADMIN)
    assert answer.status_code == 200
    want = everything(table_versions(deployment, keys))
    got = lambda: versions_by_key(receiver.acknowledged("/dying"))  # noqa: E731
    wait_until(lambda: got() == want, WAIT_S, "the held changes after resuming")
    assert endpoint(api, hook["id"])["failing_since"] is None


def test_private_addresses_are_refused_at_registration_and_when_connecting_unless_allowed(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    strict = create_app(deployment.model_copy(update={"webhook_allow_private": False}))
    try:
        client = strict.test_client()
        for url in (
            receiver.url("/private"),
            "http://localhost:9/x",
            "http://[::ffff:127.0.0.1]:9/x",
            "http://169.254.169.254/latest/meta-data",
            "http://10.0.0.1/x",
        ):
            answer = client.post("/webhooks", json={"url": url, "view": "customers"}, headers=ADMIN)
            assert answer.status_code == 422, (url, answer.get_json())
            assert answer.get_json()["error"]["details"][0]["field"] == "url"
    finally:
        close_app(strict)
    # Registered where private addresses were allowed, delivered by a dispatcher that refuses
    # them: refused when connecting, nothing reaches the receiver.
    dispatch(webhook_allow_private=False)
    keys, group = _keys(1)
    hook = register(api, receiver.url("/private"), group)
    insert_customers(deployment, keys, group)
    wait_until(
        lambda: (endpoint(api, hook["id"])["last_error"] or "").startswith("refused:"),
        WAIT_S,
        "the refusal",
    )
    assert "127.0.0.1 is a loopback address" in endpoint(api, hook["id"])["last_error"]
    assert receiver.of("/private") == []


def test_redirects_are_not_followed(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch(webhook_retry_window_s=0.5)
    receiver.behaviours["/moved"] = lambda n: (307, {"Location": receiver.url("/target")})
    keys, group = _keys(1)
    hook = register(api, receiver.url("/moved"), group)
    insert_customers(deployment, keys, group)
    wait_until(lambda: dead_letters(api, hook["id"], "failed"), WAIT_S, "the dead letter")
    [letter] = dead_letters(api, hook["id"], "failed")
    assert letter["last_error"] == "HTTP 307: redirects are not followed"
    assert receiver.of("/target") == [] and len(receiver.of("/moved")) >= 2


def test_registration_is_validated_and_for_admins_only(
    api: FlaskClient, receiver: Receiver
) -> None:
    url = receiver.url("/validated")

    def post(body: dict[str, Any], headers: dict[str, str] = ADMIN) -> Any:
        return api.post("/webhooks", json=body, headers=headers)

    reader = {"Authorization": f"Bearer {token('views:read')}"}
    assert post({"url": url, "view": "customers"}, reader).status_code == 403
    assert api.get("/webhooks").status_code == 401
    for body, field in (
        ({"url": url, "view": "nope"}, "view"),
        ({"url": url, "view": "customers", "filter": {"version": 1}}, "filter.version"),
        ({"url": url, "view": "customers", "filter": []}, "filter"),
        ({"url": url, "view": "customers", "secret": "hunter2"}, "secret"),
        ({"url": url, "view": "customers", "from": "yesterday"}, "from"),
        ({"url": "ftp://example.com/", "view": "customers"}, "url"),
        ({"url": url, "view": "customers", "colour": "red"}, "colour"),
    ):
        answer = post(body)
        assert answer.status_code == 422, (body, answer.get_json())
        assert answer.get_json()["error"]["details"][0]["field"] == field, answer.get_json()
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    made = post({"url": url, "view": "customers", "secret": secret, "from": "beginning"})
    assert made.status_code == 201 and made.get_json()["secret"] == secret
    assert made.get_json()["cursor"] == 0 and made.headers["Location"].endswith(
        made.get_json()["id"]
    )
    shown = api.get(f"/webhooks/{made.get_json()['id']}", headers=ADMIN).get_json()
    assert "secret" not in shown and shown["filter"] == {}
    bad = api.patch(f"/webhooks/{shown['id']}", json={"status": "gone"}, headers=ADMIN)
    assert bad.status_code == 422
    assert api.delete(f"/webhooks/{shown['id']}", headers=ADMIN).status_code == 204
    assert api.delete(f"/webhooks/{shown['id']}", headers=ADMIN).status_code == 404


def test_an_undecodable_changelog_record_is_counted_and_passed_and_later_changes_arrive(
    api: FlaskClient, receiver: Receiver, dispatch: Dispatch, deployment: Settings
) -> None:
    dispatch()
    keys, group = _keys(2)
    hook = register(api, receiver.url("/undecodable"), group)
    insert_customers(deployment, keys, group)
    Writer(deployment, keys, total=4).run()
    got = lambda: versions_by_key(receiver.acknowledged("/undecodable"))  # noqa: E731
    first = everything(table_versions(deployment, keys))
    wait_until(lambda: got() == first, WAIT_S, "the changes before the bad record")

    topic = Topics(deployment.topic_prefix).cdc("customers")
    producer = KafkaProducer(bootstrap_servers=deployment.kafka(), acks="all")
    try:  # a record no CDC would write: no headers, a value that is not JSON
        producer.send(topic, key=b"{", value=b"\x00not json", partition=0).get(30)
    finally:
        producer.close(timeout=10)
    Writer(deployment, keys, total=4).run()
    want = everything(table_versions(deployment, keys))
    wait_until(lambda: got() == want, WAIT_S, "the changes after the bad record")
    shown = endpoint(api, hook["id"])
    assert shown["skipped_offsets"] == 1 and shown["status"] == "active"
