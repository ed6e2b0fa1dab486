"""The processor's side of data subjects' keys (guarantee 27): their table, and the store that
seals events' personal fields with them and destroys a subject's key when it is erased
(`events/keys.py` says how values are sealed and opened)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import psycopg
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import Column, DateTime, LargeBinary, Table, Text, func

from commands.errors import Rejected, gone
from events.keys import seal
from projections import metadata

log = logging.getLogger(__name__)

CACHED = 100_000  # subjects' keys a processor keeps in memory
BACKOFF_S = 1.0  # after the store was found out of reach

# Only the processors (the tables' owner) read and write it: the API's login has no grant.
subject_keys = Table(
    "subject_keys",
    metadata,
    Column("subject", Text, primary_key=True),  # "<aggregate type>:<aggregate id>"
    Column("key", LargeBinary),  # NULL once erased
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("erased_at", DateTime(timezone=True)),
)


class KeyStore:
    """The processor's: seals events' personal fields with their subject's key (made on first
    use) and destroys a subject's key when it is erased. Keys are cached: a subject's commands
    are all decided by one processor (the owner of its partition), which is also the one that
    erases it."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self._conn: psycopg.Connection[Any] | None = None
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._down_until = 0.0  # (monotonic) refusing at once until then

    def seal(self, subject_: str, data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        key = self._key(subject_)
        return {
            name: seal(key, subject_, v) if name in fields and isinstance(v, str) else v
            for name, v in data.items()
        }

    def erase(self, subject_: str) -> None:
        with self._lock:
            self._cache.pop(subject_, None)
            self._execute(
                "INSERT INTO subject_keys (subject, key, erased_at) VALUES (%s, NULL, now()) "
                "ON CONFLICT (subject) DO UPDATE SET key = NULL, "
                "erased_at = coalesce(subject_keys.erased_at, now())",
                (subject_,),
            )

    def _key(self, subject_: str) -> bytes:
        with self._lock:
            if subject_ in self._cache:
                self._cache.move_to_end(subject_)
                return self._cache[subject_]
            row = self._execute(
                "WITH made AS (INSERT INTO subject_keys (subject, key) VALUES (%s, %s) "
                "ON CONFLICT (subject) DO NOTHING RETURNING key) "
                "SELECT key FROM made UNION ALL SELECT key FROM subject_keys WHERE subject = %s",
                (subject_, AESGCM.generate_key(256), subject_),
            )
            if row is None:  # made by another at the same moment (after this one's snapshot)
                row = self._execute("SELECT key FROM subject_keys WHERE subject = %s", (subject_,))
            if row is None or row[0] is None:
                raise gone(f"{subject_.replace(':', ' ', 1)} was erased")
            key = bytes(row[0])
            self._cache[subject_] = key
            if len(self._cache) > CACHED:
                self._cache.popitem(last=False)
            return key

    def _execute(self, query: str, params: tuple[Any, ...]) -> Any:
        """One statement, on a connection made again once if it broke. Out of reach, the
        store refuses at once for `BACKOFF_S` (the partition's other commands do not wait on
        a connect timeout each)."""
        if time.monotonic() < self._down_until:
            raise _unavailable()
        for attempt in (1, 2):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                cursor = self._conn.execute(query, params)
                return cursor.fetchone() if cursor.description else None
            except psycopg.OperationalError as e:
                self.close()
                if attempt == 2:
                    log.warning("the key store is unreachable: %s", e)
                    self._down_until = time.monotonic() + BACKOFF_S
                    raise _unavailable() from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _unavailable() -> Rejected:
    return Rejected(
        "unavailable", "the key store (Postgres) is unreachable; nothing was written, retry"
    )
