"""Standard Webhooks signatures: secrets as `whsec_<base64>`, and `webhook-signature` as
`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` (standardwebhooks.com)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

PREFIX = "whsec_"
# The specification asks for keys of 24 to 64 bytes; generated ones have 32.
MIN_KEY_BYTES, MAX_KEY_BYTES, NEW_KEY_BYTES = 24, 64, 32


class BadSecret(ValueError):
    pass


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(NEW_KEY_BYTES)).decode()


def key_of(secret: str) -> bytes:
    """The HMAC key a `whsec_<base64>` secret stands for; BadSecret if it is not one."""
    if not secret.startswith(PREFIX):
        raise BadSecret(f"a secret is {PREFIX}<base64 of {MIN_KEY_BYTES}-{MAX_KEY_BYTES} bytes>")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadSecret(f"the secret after {PREFIX} is not base64") from e
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise BadSecret(f"the secret's key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes")
    return key


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header of one attempt (`v1,<base64>`)."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(key_of(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of one delivery attempt: the id stays, the timestamp is the attempt's."""
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, body),
    }


def verify(secret: str, message_id: str, timestamp: int, body: bytes, header: str) -> bool:
    """Whether one of the space-separated signatures of `header` is this message's (for
    receivers written with Logfold's code; any Standard Webhooks library does the same)."""
    expected = signature(secret, message_id, timestamp, body)
    return any(hmac.compare_digest(expected, s) for s in header.split(" ") if s)
