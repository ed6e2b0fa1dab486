"""The waits of a long-running loop between attempts at what failed (a session with Kafka, a
stream from Postgres): doubling from the first to the longest while the failures go on, and
back to the first once an attempt got somewhere. The longest bounds how late the loop notices
that what it waits for is back."""

from __future__ import annotations


class Backoff:
    def __init__(self, first: float, longest: float) -> None:
        self.first, self.longest = first, longest
        self.current = first

    def next(self) -> float:
        """The wait before the next attempt; the one after it doubles (up to the longest)."""
        wait = self.current
        self.current = min(self.current * 2, self.longest)
        return wait

    def reset(self) -> None:
        """An attempt got somewhere: the next failure waits the first wait again."""
        self.current = self.first
