"""Personal fields sealed with their subject's key, and opened (crypto-shredding, guarantee 27).

Each aggregate whose events have personal fields (`DomainEvent.PERSONAL`) is a data subject
with a key of its own: 256 random bits in `subject_keys` (Postgres, never in the log), made
when its first personal field is written (`commands/keys.py`, the processor's). A personal
field is stored sealed: AES-GCM (the `cryptography` library) under its subject's key, with a
fresh 96-bit nonce and the subject as associated data (a sealed value cannot be moved to
another subject), written as `PREFIX + base64(nonce || ciphertext || tag)`. Values without
the prefix are clear (events written before sealing existed) and are read as they are.

Erasing a subject (an event with `ERASES`) destroys its key: its sealed fields, in every event
of the log, can no longer be opened; where a view would show one, it shows `ERASED`.

The log, Spark and the rows topics only ever hold sealed values: they are opened as a view's
rows enter Postgres (`open_rows`, in the projector's transaction, and in a rebuild's load)."""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable
from typing import Any

import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from events.base import ERASED

PREFIX = "\x1epf1:"  # a control character no command's text field accepts
# What every sealed value contains in JSON text, however the control character is escaped.
MARK = PREFIX[1:]


def subject(aggregate_type: str, aggregate_id: str) -> str:
    return f"{aggregate_type}:{aggregate_id}"


def is_sealed(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def seal(key: bytes, subject_: str, value: str) -> str:
    nonce = os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, value.encode(), subject_.encode())
    return PREFIX + base64.b64encode(nonce + sealed).decode()


def open_value(key: bytes | None, subject_: str, value: Any) -> Any:
    """`value` opened with `subject_`'s `key`; `ERASED` without a key (or when it does not
    open with it); as it is when it is not sealed."""
    if not is_sealed(value):
        return value
    if key is None:
        return ERASED
    try:
        raw = base64.b64decode(value[len(PREFIX) :], validate=True)
        return AESGCM(key).decrypt(raw[:12], raw[12:], subject_.encode()).decode()
    except (InvalidTag, ValueError, binascii.Error):
        return ERASED


def find_keys(conn: psycopg.Connection[Any], subjects: Iterable[str]) -> dict[str, bytes]:
    """The keys of `subjects` that exist (an erased subject's is gone)."""
    rows = conn.execute(
        "SELECT subject, key FROM subject_keys WHERE subject = ANY(%s) AND key IS NOT NULL",
        (list(set(subjects)),),
    ).fetchall()
    return {str(s): bytes(k) for s, k in rows}


def open_rows(
    conn: psycopg.Connection[Any],
    rows: list[dict[str, Any]],
    personal: dict[str, tuple[str, str]],
) -> None:
    """Open, in place, the sealed values of `rows`' `personal` columns (column -> the
    aggregate type of its subject and the column holding its id)."""
    wanted = {
        subject(kind, str(row[id_column]))
        for row in rows
        for column, (kind, id_column) in personal.items()
        if is_sealed(row.get(column))
    }
    if not wanted:
        return
    keys = find_keys(conn, wanted)
    for row in rows:
        for column, (kind, id_column) in personal.items():
            if is_sealed(row.get(column)):
                who = subject(kind, str(row[id_column]))
                row[column] = open_value(keys.get(who), who, row[column])
