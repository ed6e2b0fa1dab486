"""Load against real API processes, for the concurrency, crash and fencing tests.

Clients are plain HTTP clients (tests.support.HttpApi). A logical command is sent until it gets a
definitive answer: a connection error, 503 or 504 is retried with the same body and the same
Idempotency-Key, against the next API process. Every HTTP attempt is recorded, so a failing test
can say exactly what each client saw. The checks at the bottom compare answers with the log."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from events.serialization import Envelope
from tests.support import HttpApi, token

# No answer at all (refused, reset, timed out), or none that says what happened: API.md says
# to send these again with the same Idempotency-Key (502: the balancer lost the node).
RETRYABLE = {None, 502, 503, 504}


@dataclass
class Attempt:
    url: str
    status: int | None
    body: Any
    replay: bool
    error: str | None
    at: float  # time.monotonic() when the answer (or the failure) arrived


class Clients:
    """One HttpApi per thread and API URL (a requests.Session must not be shared by threads)."""

    def __init__(self, urls: Sequence[str], bearer: str | None = None) -> None:
        self.urls = list(urls)
        self.bearer = bearer or token("commands:write")
        self._local = threading.local()

    def api(self, url: str) -> HttpApi:
        apis: dict[str, HttpApi] = self._local.__dict__.setdefault("apis", {})
        if url not in apis:
            apis[url] = HttpApi(url, self.bearer)
        return apis[url]


@dataclass
class Logical:
    """One logical command and every HTTP attempt made for it."""

    index: int
    name: str
    data: dict[str, Any]
    key: str | None = None
    aggregate_id: str | None = None
    expected_version: int | None = None
    attempts: list[Attempt] = field(default_factory=list)
    replays: list[list[Attempt]] = field(default_factory=list)  # re-sends once answered

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def answered(self) -> bool:
        return self.final is not None and self.final.status not in RETRYABLE

    @property
    def committed(self) -> bool:
        """Answered with events: a 201, or a 200 replay of one."""
        return self.answered and self.final is not None and self.final.status in (200, 201)

    def describe(self) -> str:
        tries = ", ".join(f"{a.url[-5:]}:{a.status or a.error}" for a in self.attempts)
        answered = self.final.body if self.final and isinstance(self.final.body, dict) else {}
        agg = self.aggregate_id or answered.get("aggregate_id")
        return f"#{self.index} {self.name} key={self.key} agg={agg} [{tries}]"


def send(api: HttpApi, cmd: Logical, timeout: float = 40) -> Attempt:
    try:
        a = api.command(
            cmd.name,
            cmd.data,
            aggregate_id=cmd.aggregate_id,
            expected_version=cmd.expected_version,
            key=cmd.key,
            timeout=timeout,
        )
    except (requests.RequestException, ValueError) as e:  # includes a body that is not JSON
        return Attempt(api.base_url, None, None, False, type(e).__name__, time.monotonic())
    replay = a.headers.get("Idempotent-Replay") == "true"
    return Attempt(api.base_url, a.status, a.body, replay, None, time.monotonic())


def until_answered(
    clients: Clients,
    cmd: Logical,
    first: int,
    give_up_at: float,
    into: list[Attempt],
    abandon: threading.Event | None = None,
) -> Attempt:
    """Send `cmd` (same key, same body) until a definitive answer, `give_up_at` (monotonic) or
    `abandon`; each retry goes to the next API process. Returns the last attempt."""
    i, backoff = first, 0.05
    while True:
        url = clients.urls[i % len(clients.urls)]
        attempt = send(clients.api(url), cmd)
        into.append(attempt)
        if attempt.status not in RETRYABLE or time.monotonic() > give_up_at:
            return attempt
        if abandon is not None and abandon.is_set():
            return attempt
        i += 1
        time.sleep(backoff)  # retry pacing, not synchronization
        backoff = min(backoff * 2, 0.5)


class Progress:
    """Counts answers; lets the test act after the n-th one without sleeping."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def tick(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float, what: str = "answers") -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= n, timeout):
                raise TimeoutError(f"only {self.count} of {n} {what} after {timeout:.0f}s")


class Background:
    """Runs `work` over `items` on a thread pool, in a background thread."""

    def __init__(self, work: Callable[[Any], None], items: Iterable[Any], threads: int) -> None:
        self.errors: list[BaseException] = []

        def run() -> None:
            with ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
                for future in [pool.submit(work, item) for item in items]:
                    if future.exception() is not None:
                        self.errors.append(future.exception())  # type: ignore[arg-type]

        self.thread = threading.Thread(target=run, name="load", daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def join(self, timeout: float) -> float:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"load still running after {timeout:.0f}s")
        if self.errors:
            raise self.errors[0]
        return time.monotonic() - self.started


def processors(url: str) -> int:
    h = requests.get(f"{url}/health", timeout=10).json()
    return int(h["components"]["command_processing"].get("processors", 0))


def status_counts(cmds: Iterable[Logical]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for c in cmds:
        for a in c.attempts + [a for r in c.replays for a in r]:
            code = (a.body or {}).get("error", {}).get("code") if isinstance(a.body, dict) else None
            counts[f"{a.status or a.error}{'/' + code if code else ''}"] += 1
    return counts


# ---- the checks: what the answers claim against what the log holds ----


def version_problems(log: Sequence[Envelope]) -> list[str]:
    """Per aggregate, versions must be exactly 1..n: no gap, no duplicate."""
    versions: dict[str, list[int]] = defaultdict(list)
    for e in log:
        versions[e.aggregate_id].append(e.version)
    problems = []
    for agg, vs in versions.items():
        if sorted(vs) != list(range(1, len(vs) + 1)):
            dups = sorted(v for v, n in Counter(vs).items() if n > 1)
            gaps = sorted(set(range(1, max(vs) + 1)) - set(vs))
            problems.append(f"{agg}: {len(vs)} events, duplicates {dups}, gaps {gaps}")
    return problems


def committed_problems(log: Sequence[Envelope], bodies: Iterable[dict[str, Any]]) -> list[str]:
    """Every event a 201 (or its replay) reported is in the log exactly once, with the
    aggregate id and version the answer gave."""
    by_id: dict[str, list[Envelope]] = defaultdict(list)
    for e in log:
        by_id[e.event_id].append(e)
    problems = []
    for body in bodies:
        for ev in body["events"]:
            found = by_id.get(ev["event_id"], [])
            if len(found) != 1:
                problems.append(f"event {ev['event_id']} of {body['aggregate_id']}: {len(found)}x")
            elif (found[0].aggregate_id, found[0].version, found[0].type) != (
                body["aggregate_id"],
                ev["version"],
                ev["type"],
            ):
                e = found[0]
                problems.append(
                    f"event {ev['event_id']}: answered {body['aggregate_id']} v{ev['version']} "
                    f"{ev['type']}, log has {e.aggregate_id} v{e.version} {e.type}"
                )
    return problems


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<{e}>"


def logs_tail(logdir: Path, lines: int = 30) -> str:
    return "\n".join(f"---- {p.name} ----\n{tail(p, lines)}" for p in sorted(logdir.glob("*.log")))
