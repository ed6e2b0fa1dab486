"""A webhook receiver for tests: a real HTTP server on a free port that records every delivery
attempt and answers as each path's behaviour says (a status, after blocking if it likes)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook

from stack.procs import free_port


@dataclass(frozen=True)
class Attempt:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def payload(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.body)
        return loaded

    @property
    def acknowledged(self) -> bool:
        return 200 <= self.status < 300


# A path's behaviour: given the attempt's number on that path (0, 1, …), the status to answer
# (it may block first) and extra headers.
Behaviour = Callable[[int], "int | tuple[int, dict[str, str]]"]


class Receiver:
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self.behaviours: dict[str, Behaviour] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    n = sum(1 for a in receiver.attempts if a.path == self.path)
                    n += receiver.pending.get(self.path, 0)
                    receiver.pending[self.path] = receiver.pending.get(self.path, 0) + 1
                behaviour = receiver.behaviours.get(self.path, lambda _: 200)
                answer = behaviour(n)
                status, extra = answer if isinstance(answer, tuple) else (answer, {})
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    receiver.pending[self.path] -= 1
                    receiver.attempts.append(Attempt(self.path, headers, body, status))
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.pending: dict[str, int] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def of(self, path: str) -> list[Attempt]:
        with self.lock:
            return [a for a in self.attempts if a.path == path]

    def acknowledged(self, path: str) -> list[Attempt]:
        return [a for a in self.of(path) if a.acknowledged]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def verified(attempts: list[Attempt], secret: str) -> list[dict[str, Any]]:
    """The payloads, each checked with the Standard Webhooks library's verifier (it raises on a
    bad signature or a stale timestamp)."""
    hook = Webhook(secret)
    return [hook.verify(a.body, a.headers) for a in attempts]


def versions_by_key(attempts: list[Attempt], key: str = "customer_id") -> dict[str, list[int]]:
    """Per key, the `version` of each upsert acknowledged, in the order received."""
    seen: dict[str, list[int]] = {}
    for a in attempts:
        p = a.payload
        if p["op"] == "upsert":
            seen.setdefault(p["key"][key], []).append(p["row"]["version"])
    return seen
