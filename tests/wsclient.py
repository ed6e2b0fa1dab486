"""A websocket test client for `/ws`: reads in a thread, keeps every message, and folds the
snapshots and changes of each subscription into the rows a real client would hold."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import websocket

from stack.procs import wait_until


class WsClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        rcvbuf: int | None = None,
        stalled: bool = False,  # reads nothing until release(): a reader that fell behind
    ) -> None:
        sockopt = [(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)] if rcvbuf else []
        full = f"{url}?token={token}" if token else url
        self.ws = websocket.create_connection(full, timeout=30, sockopt=sockopt)
        self.messages: list[dict[str, Any]] = []
        self.close_code: int | None = None
        self._lock = threading.Lock()
        self._released = threading.Event()
        if not stalled:
            self._released.set()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let a `stalled` client read what the server kept for it."""
        self._released.set()

    def _read(self) -> None:
        self._released.wait()
        while True:
            try:
                opcode, data = self.ws.recv_data()
            except (websocket.WebSocketException, OSError):
                if self.close_code is None:
                    self.close_code = 1006
                return
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                self.close_code = int.from_bytes(data[:2], "big") if len(data) >= 2 else 1005
                return
            with self._lock:
                self.messages.append(json.loads(data))

    def send(self, message: dict[str, Any]) -> None:
        self.ws.send(json.dumps(message))

    def subscribe(
        self, sub_id: str, view: str, filter: dict[str, Any] | None = None, since: str | None = None
    ) -> None:
        self.send(
            {"op": "subscribe", "id": sub_id, "view": view, "filter": filter or {}, "since": since}
        )

    def of(self, sub_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [
                m
                for m in self.messages
                if m.get("id") == sub_id and (kind is None or m["type"] == kind)
            ]

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        wait_until(check, timeout, what)

    def wait_closed(self, timeout: float = 60) -> int:
        wait_until(lambda: self.close_code is not None, timeout, "the server to close")
        assert self.close_code is not None
        return self.close_code

    def last_position(self, sub_id: str) -> str | None:
        found = [m["position"] for m in self.of(sub_id) if "position" in m]
        return found[-1] if found else None

    def close(self) -> None:
        with contextlib.suppress(websocket.WebSocketException, OSError):
            self.ws.close()


def fold(messages: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    """The rows a client holds after these messages of one subscription."""
    rows: dict[Any, dict[str, Any]] = {}
    for m in messages:
        if m["type"] == "snapshot":
            rows = {r[key]: r for r in m["rows"]}
        elif m["type"] == "resync":
            rows = {}
        elif m["type"] == "change":
            if m["op"] == "upsert":
                rows[m["key"][key]] = m["row"]
            else:
                rows.pop(m["key"][key], None)
    return rows


def positions(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    out = []
    for m in messages:
        if m["type"] == "change":
            lsn, _, seq = m["position"].partition(".")
            out.append((int(lsn), int(seq)))
    return out
