"""An open-loop HTTP load generator light enough to share two cores with the system it loads.

Requests are scheduled at a fixed rate and latency is measured from the scheduled send time, so
a slow server cannot hide its queueing (no coordinated omission). It speaks just enough
HTTP/1.1 over a pool of keep-alive connections (asyncio streams, no client library): with
`requests` and a thread per request, the generator alone used more CPU than the API it loaded.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


@dataclass
class Result:
    offered: float
    wall_s: float
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def completed_per_s(self) -> float:
        return self.statuses.get(201, 0) / self.wall_s

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1e3

    def summary(self) -> dict[str, object]:
        return {
            "offered": self.offered,
            "completed_per_s": self.completed_per_s,
            "p50_ms": self.ms(0.5),
            "p99_ms": self.ms(0.99),
            "statuses": self.statuses,
        }


class _Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        for attempt in (1, 2):  # a keep-alive connection the server closed: reconnect once
            try:
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                assert self.reader is not None
                self.writer.write(head + body)
                status_line = await self.reader.readuntil(b"\r\n")
                if not status_line:
                    raise ConnectionError("closed")
                length, close = 0, False
                while True:
                    line = await self.reader.readuntil(b"\r\n")
                    if line == b"\r\n":
                        break
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                payload = await self.reader.readexactly(length)
                if close:
                    self.close()
                return int(status_line.split(b" ", 2)[1]), payload
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


Body = Callable[[int], tuple[str, bytes]]  # request number -> (path, JSON body)
# Called with each answer as it arrives: request number, status, body (599 and b"" when the
# connection failed). Runs on the generator's loop: it must be quick.
Answered = Callable[[int, int, bytes], None]


async def _run(
    urls: list[str],
    bearer: str,
    body: Body,
    rate: float,
    duration: float,
    connections: int,
    answered: Answered | None = None,
) -> Result:
    pools: list[asyncio.Queue[_Connection]] = []
    for url in urls:
        parts = urlsplit(url)
        pool: asyncio.Queue[_Connection] = asyncio.Queue()
        for _ in range(max(connections // len(urls), 1)):
            pool.put_nowait(_Connection(parts.hostname or "127.0.0.1", parts.port or 80))
        pools.append(pool)
    total = int(rate * duration)
    result = Result(rate, 0.0)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2

    async def one(i: int) -> None:
        scheduled = start + i / rate
        pool = pools[i % len(pools)]
        conn = await pool.get()
        try:
            path, payload = body(i)
            head = (
                f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {bearer}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode()
            try:
                status, answer = await conn.request(head, payload)
            except (OSError, asyncio.IncompleteReadError):
                status, answer = 599, b""
        finally:
            pool.put_nowait(conn)
        if answered is not None:
            answered(i, status, answer)
        result.latencies.append(loop.time() - scheduled)
        result.statuses[status] = result.statuses.get(status, 0) + 1

    in_flight: set[asyncio.Task[None]] = set()  # only these: finished tasks are let go
    for i in range(total):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    result.wall_s = loop.time() - start
    for pool in pools:
        while not pool.empty():
            pool.get_nowait().close()
    return result


def offered_load(
    urls: list[str],
    bearer: str,
    body: Body,
    rate: float,
    duration: float,
    connections: int = 256,
    answered: Answered | None = None,
) -> Result:
    """Send `rate` requests/s for `duration` s, spread over `urls` and `connections`; each
    answer is also handed to `answered`, if given."""
    # A full collection of the generator's heap would stall sends and receipts alike and count
    # as the system's latency: what is alive before the run is left out of collections.
    gc.collect()
    gc.freeze()
    return asyncio.run(_run(urls, bearer, body, rate, duration, connections, answered))


def renames(ids: list[str]) -> Body:
    """`rename-customer` on the customers `ids`, in turn."""

    def body(i: int) -> tuple[str, bytes]:
        doc = {"aggregate_id": ids[i % len(ids)], "data": {"name": f"n{i}"}}
        return "/commands/rename-customer", json.dumps(doc).encode()

    return body


def closed_loop(workers: int, seconds: float, work: Callable[[int], None]) -> float:
    """Operations/s of `workers` threads each calling `work(its index)` in a loop for
    `seconds`, as fast as they can."""
    done = [0] * workers
    stop = time.perf_counter() + seconds

    def loop(w: int) -> None:
        while time.perf_counter() < stop:
            work(w)
            done[w] += 1

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def rounds(items: list[T], workers: int) -> Callable[[int], T]:
    """`next_for(w)`: worker `w`'s next item, going round its own share of `items` (so no two
    workers touch the same one)."""
    turn = [0] * workers

    def next_for(w: int) -> T:
        mine = items[w::workers]
        turn[w] += 1
        return mine[(turn[w] - 1) % len(mine)]

    return next_for
