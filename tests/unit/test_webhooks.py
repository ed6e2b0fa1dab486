"""The webhooks' pure parts: Standard Webhooks signatures, the retry schedule, the address
policy (and that it holds at connect time, whatever a name resolved to before), and what a
delivery carries."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from typing import Any

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from cdc.changes import Change, WalPosition
from webhooks import backoff, outbound, signing
from webhooks.addresses import Refused, check_url, refusal
from webhooks.messages import message_for
from webhooks.outbound import Sender

# The example of the Standard Webhooks specification (and of its libraries' tests).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID, SPEC_TIMESTAMP = "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_signature_is_the_specifications_example() -> None:
    assert signing.signature(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    assert signing.verify(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY, SPEC_SIGNATURE)
    assert not signing.verify(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP + 1, SPEC_BODY, SPEC_SIGNATURE)


def test_the_standardwebhooks_library_verifies_a_delivery_with_a_new_secret() -> None:
    secret = signing.new_secret()
    assert secret.startswith("whsec_") and len(signing.key_of(secret)) == 32
    body = b'{"type":"change","view":"customers"}'
    stamp = int(datetime.now(UTC).timestamp())
    headers = signing.headers(secret, "msg_1", stamp, body)
    assert Webhook(secret).verify(body, headers) == json.loads(body)
    tampered = body.replace(b"customers", b"orders")
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(tampered, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(signing.new_secret()).verify(body, headers)


@pytest.mark.parametrize(
    "secret", ["", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_c2hvcnQ="]
)
def test_a_secret_that_is_not_whsec_base64_of_24_to_64_bytes_is_refused(secret: str) -> None:
    with pytest.raises(signing.BadSecret):
        signing.key_of(secret)


def test_backoff_waits_at_most_the_doubling_ceiling_and_never_beyond_the_cap() -> None:
    base, cap = 2.0, 60.0
    for attempt in range(1, 80):
        ceiling = min(cap, base * 2 ** (attempt - 1))
        assert backoff.delay(attempt, base, cap, lambda: 0.0) == 0.0
        top = backoff.delay(attempt, base, cap, lambda: 0.999999)
        assert ceiling * 0.99 <= top <= ceiling
    assert backoff.delay(3, base, cap) <= 8.0  # the real generator, within [0, 8]
    with pytest.raises(ValueError):
        backoff.delay(0, base, cap)


def test_a_retry_beyond_the_window_is_not_scheduled() -> None:
    half = lambda: 0.5  # noqa: E731
    assert backoff.next_attempt_in(1, 0.0, 10.0, 2.0, 60.0, half) == 1.0
    assert backoff.next_attempt_in(4, 5.0, 10.0, 2.0, 60.0, half) is None  # 5 + 8 > 10
    assert backoff.next_attempt_in(4, 1.0, 10.0, 2.0, 60.0, half) == 8.0  # 1 + 8 <= 10


REFUSED = [
    "127.0.0.1",
    "127.255.0.9",
    "10.1.2.3",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "169.254.169.254",  # the cloud metadata service
    "0.0.0.0",
    "100.64.0.1",  # carrier-grade NAT
    "224.0.0.1",
    "::1",
    "::",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "::10.0.0.1",  # IPv4-compatible
    "2002:a00:1::",  # 6to4 of 10.0.0.1
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "172.32.0.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_loopback_link_local_and_private_addresses_are_refused(address: str) -> None:
    assert refusal(address) is not None
    scheme_host = f"[{address}]" if ":" in address else address
    with pytest.raises(Refused):
        check_url(f"http://{scheme_host}:8080/hook", allow_private=False)
    assert check_url(f"http://{scheme_host}:8080/hook", allow_private=True)[2] == 8080


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address: str) -> None:
    assert refusal(address) is None


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/x",
        "file:///etc/passwd",
        "http:///nohost",
        "https://user:pass@example.com/",
        "http://localhost:9/x",
        "http://api.localhost/x",
        "http://example.com:99999/",
        "not a url",
    ],
)
def test_urls_that_are_not_plain_http_to_a_host_are_refused(url: str) -> None:
    with pytest.raises(Refused):
        check_url(url, allow_private=False)


def test_the_address_is_checked_when_connecting_so_dns_rebinding_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name that was public when registered and resolves to the metadata service now: the
    connection is refused before a socket is opened, and the delivery fails with the reason."""
    assert check_url("http://rebinding.example/hook", allow_private=False)[1] == "rebinding.example"
    opened: list[Any] = []

    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "socket", lambda *a: opened.append(a))
    with pytest.raises(Refused, match=r"169\.254\.169\.254 is a link-local address"):
        outbound.connect("rebinding.example", 80, 1.0, allow_private=False)
    outcome = Sender().post("http://rebinding.example/hook", b"{}", {})
    assert outcome.status is None and outcome.error is not None
    assert outcome.error.startswith("refused:") and not outcome.acknowledged
    assert opened == []


def _change(op: str, row: dict[str, Any] | None, before: dict[str, Any] | None) -> Change:
    key = {"customer_id": "c1"}
    return Change("customers", op, key, row, before, WalPosition(123456, 7))  # type: ignore[arg-type]


def test_a_delivery_carries_the_change_as_the_filter_sees_it() -> None:
    row = {"customer_id": "c1", "name": "Ada", "version": 2}
    change = _change("update", row, {**row, "version": 1})
    message = message_for("ep_1", "customers", {"name": "Ada"}, change, offset=41)
    assert message is not None
    assert message.id == "msg_ep_1_123456_7" and message.offset == 41
    assert json.loads(message.body) == {
        "type": "change",
        "view": "customers",
        "op": "upsert",
        "key": {"customer_id": "c1"},
        "row": row,
        "position": "123456.7",
    }
    # the same change, another time (a retry, a restart, a resend by CDC): the same id
    again = message_for("ep_1", "customers", {"name": "Ada"}, change, offset=41)
    assert again is not None and again.id == message.id and again.body == message.body


def test_a_row_leaving_the_filter_or_deleted_is_a_delete_and_others_are_not_sent() -> None:
    ada, bob = {"customer_id": "c1", "name": "Ada"}, {"customer_id": "c1", "name": "Bob"}
    left = message_for("ep_1", "customers", {"name": "Ada"}, _change("update", bob, ada), 1)
    assert left is not None
    assert json.loads(left.body)["op"] == "delete" and json.loads(left.body)["row"] is None
    deleted = message_for("ep_1", "customers", {}, _change("delete", None, ada), 2)
    assert deleted is not None and json.loads(deleted.body)["op"] == "delete"
    assert message_for("ep_1", "customers", {"name": "Cy"}, _change("update", bob, ada), 3) is None
