"""`logfold webhooks`: keeps one worker (`worker.py`) running for each active endpoint.

It looks at the endpoints when the API notifies it (`NOTIFY logfold_webhooks`, at once) and
every LOGFOLD_WEBHOOK_POLL_S besides (a notification can be missed while its connection is
down): a worker starts for each active endpoint without one, is told to stop when its endpoint
is paused or deleted, and starts again after a failure (Kafka or Postgres away). Several
dispatchers may run: each endpoint's advisory lock lets one worker at a time deliver it, and the
others take over when its holder dies (their next look finds it free)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg

from config.settings import Settings
from webhooks.outbound import Sender
from webhooks.store import WebhookStore
from webhooks.worker import Worker

log = logging.getLogger("logfold.webhooks")

# How long a worker that failed waits before it starts again, and how often the dispatcher
# checks whether it was told to stop while waiting for a notification.
RESTART_S = 2.0
WAKE_S = 0.5
STOP_S = 20.0


class Dispatcher:
    def __init__(self, settings: Settings, sender: Sender | None = None) -> None:
        self.settings = settings
        self.store = WebhookStore(settings.database())
        self.sender = sender or Sender(
            allow_private=settings.webhook_allow_private,
            connect_timeout=settings.webhook_connect_timeout_s,
            timeout=settings.webhook_timeout_s,
            max_response_bytes=settings.webhook_max_response_bytes,
        )
        self.workers: dict[str, Worker] = {}
        self.not_before: dict[str, float] = {}  # endpoint -> when its worker may start again
        self._stop = threading.Event()

    def run(self) -> None:
        log.info(
            "webhook dispatcher started (private addresses %s)",
            "allowed" if self.settings.webhook_allow_private else "refused",
        )
        while not self._stop.is_set():
            try:
                with self.store.listening() as listener:
                    self._watch(listener)
            except psycopg.OperationalError as e:
                log.warning("webhook dispatcher: Postgres unavailable (%s); retrying", e)
                self._stop.wait(RESTART_S)
        for worker in self.workers.values():
            worker.stop()
        deadline = time.monotonic() + STOP_S
        for worker in self.workers.values():
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        log.info("webhook dispatcher stopped")

    def _watch(self, listener: psycopg.Connection[Any]) -> None:
        while not self._stop.is_set():
            self.reconcile()
            # Sooner while a worker is on its way out or waits to start again.
            poll = self.settings.webhook_poll_s
            if self.not_before or any(w.stopping.is_set() for w in self.workers.values()):
                poll = min(poll, RESTART_S)
            waited, notified = 0.0, False
            while not (notified or self._stop.is_set()) and waited < poll:
                timeout = min(WAKE_S, poll - waited)
                notified = any(True for _ in listener.notifies(timeout=timeout, stop_after=1))
                waited += timeout

    def reconcile(self) -> None:
        """Workers for the active endpoints, and for them only."""
        active = {e.id: e for e in self.store.active()}
        replaying = self.store.replaying()
        now = time.monotonic()
        for endpoint_id, running in list(self.workers.items()):
            if not running.alive:
                del self.workers[endpoint_id]
                if running.crashed:
                    self.not_before[endpoint_id] = now + RESTART_S
            elif endpoint_id not in active:
                running.stop()
        for endpoint_id, endpoint in active.items():
            worker = self.workers.get(endpoint_id)
            if worker is None and self.not_before.get(endpoint_id, 0.0) <= now:
                worker = self.workers[endpoint_id] = Worker(
                    endpoint, self.settings, self.store, self.sender
                )
                worker.start()
            if worker is not None and endpoint_id in replaying:
                worker.replay_wanted.set()
        for endpoint_id in set(self.not_before) - set(active):
            del self.not_before[endpoint_id]

    def stop(self) -> None:
        self._stop.set()
