"""Which websockets an API process admits, and how fast a connection may subscribe: each socket
holds a server thread for its whole life, and each subscribe takes a snapshot."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Ticket:
    """Which of `Admission`'s pools a socket holds a place in: `pending` while it waits for
    its `auth` message, `open` once authenticated."""

    pool: str
    address: str


class Admission:
    """How many websockets this API process holds. Each holds a server thread for its whole
    life, so together they take at most the threads not reserved for REST.

    A socket whose handshake carried a valid token is admitted at once, into `max_open`
    places, at most `max_per_subject` per token subject. One without (it will send an `auth`
    message, or nothing) waits in a small pool of its own, `max_pending` places, at most
    `max_pending_per_address` per client address, for `ws_auth_timeout_s` at most: a flood of
    sockets that never authenticate fills that pool, never the admitted one."""

    def __init__(
        self,
        max_open: int,
        max_per_subject: int,
        max_pending: int = 32,
        max_pending_per_address: int = 8,
    ) -> None:
        self.max_open, self.max_per_subject = max_open, max_per_subject
        self.max_pending, self.max_pending_per_address = max_pending, max_pending_per_address
        self.open = 0
        self.subjects: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # per client address
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self.open >= self.max_open:
                return False
            self.open += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.open -= 1

    def enter_pending(self, address: str) -> str | None:
        """A place to wait for the `auth` message, or why not: `full` or `address`."""
        with self._lock:
            if sum(self.pending.values()) >= self.max_pending:
                return "full"
            if self.pending.get(address, 0) >= self.max_pending_per_address:
                return "address"
            self.pending[address] = self.pending.get(address, 0) + 1
            return None

    def leave_pending(self, address: str) -> None:
        with self._lock:
            _drop(self.pending, address)

    def promote(self, ticket: Ticket) -> bool:
        """Move an authenticated socket from the pending pool to the admitted one."""
        with self._lock:
            if ticket.pool != "pending" or self.open >= self.max_open:
                return False
            _drop(self.pending, ticket.address)
            self.open += 1
            ticket.pool = "open"
            return True

    def release(self, ticket: Ticket) -> None:
        if ticket.pool == "open":
            self.leave()
        elif ticket.pool == "pending":
            self.leave_pending(ticket.address)
        ticket.pool = "none"

    def enter_subject(self, subject: str) -> bool:
        with self._lock:
            if self.subjects.get(subject, 0) >= self.max_per_subject:
                return False
            self.subjects[subject] = self.subjects.get(subject, 0) + 1
            return True

    def leave_subject(self, subject: str) -> None:
        with self._lock:
            _drop(self.subjects, subject)


def _drop(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 1) - 1
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


class TokenBucket:
    """`burst` at once, then `rate` a second."""

    def __init__(self, burst: int, rate: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> float:
        """0 when one is taken; else the seconds until one will be there (none is taken)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate
