"""A server-sent events test client for `/views/<view>/events`: a real SSE parser (sseclient-py)
over a streamed `requests` response, read in a thread; keeps every event as the message its
data holds (with the event's `id`), so the websocket helpers (`fold`, `versions_seen`) apply."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import requests
import sseclient

from stack.procs import wait_until


class SseClient:
    def __init__(
        self,
        base: str,  # http://host:port
        view: str,
        token: str,
        filter: dict[str, Any] | None = None,
        last_event_id: str | None = None,
        **params: Any,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.response = requests.get(
            f"{base}/views/{view}/events",
            params={**(filter or {}), **params},
            headers=headers,
            stream=True,
            timeout=(10, 60),
        )
        self.status = self.response.status_code
        self.messages: list[dict[str, Any]] = []
        self.ids: list[str] = []  # the `id:` of each event that had one, in order
        self.ended = False
        self._lock = threading.Lock()
        if self.status == 200:
            threading.Thread(target=self._read, daemon=True).start()
        else:
            self.error = self.response.json()["error"]
            self.response.close()

    def _read(self) -> None:
        try:
            for event in sseclient.SSEClient(self.response).events():
                message = json.loads(event.data) if event.data else {}
                with self._lock:
                    message["_event"], message["_id"] = event.event, event.id
                    self.messages.append(message)
                    if event.id:
                        self.ids.append(event.id)
        except (requests.RequestException, OSError, ValueError, AttributeError):
            pass  # the stream ended, or was closed by `close` (its file gone under the reader)
        finally:
            self.ended = True

    def of(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.messages if kind is None or m["_event"] == kind]

    def last_id(self) -> str | None:
        with self._lock:
            return self.ids[-1] if self.ids else None

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        wait_until(check, timeout, what)

    def close(self) -> None:
        with contextlib.suppress(OSError, requests.RequestException):
            self.response.close()
