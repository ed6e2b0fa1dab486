"""Serving the API with gunicorn: gevent workers (the default: a greenlet per connection, for
tens of thousands of websockets in one process), or threaded ones (`LOGFOLD_API_WORKER=gthread`);
flask-sock's websockets work under both."""

from __future__ import annotations

import resource
from typing import Any

from gunicorn.app.base import BaseApplication

from config.logs import is_debug
from config.settings import Settings


class ApiServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings, workers: int = 1) -> None:
        self.settings = settings
        gevent = settings.api_worker == "gevent"
        self.options = {
            "bind": f"{settings.api_host}:{settings.api_port}",
            "worker_class": "gevent" if gevent else "gthread",
            "workers": workers,
            "threads": settings.api_threads,
            # gthread: each open websocket holds a thread, up to `ws_max_open`; the reserved
            # threads serve plain requests. Accept more connections than that, so the ones that
            # must be refused (server full) are answered at once instead of waiting in the
            # backlog. gevent: the connections one process holds.
            "worker_connections": (
                settings.api_connections + 100 if gevent else settings.api_threads * 2 + 100
            ),
            "timeout": 60,
            "graceful_timeout": 10,
            "accesslog": None,
            "loglevel": "info" if is_debug(settings.log_level) else "warning",
            "post_worker_init": _drain_on_stop,
        }
        _raise_open_files(settings.api_connections + 1000 if gevent else 0)
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        # Runs in each worker after the fork (and, under gevent, after the worker patched the
        # standard library), so Kafka clients and threads belong to it.
        import faulthandler
        import signal

        if self.settings.api_worker == "gevent":
            cooperative()

        from app import create_app

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: thread dump

        return create_app(self.settings)


def _drain_on_stop(worker: Any) -> None:
    """When the worker is told to stop (SIGTERM: gunicorn stops accepting, so a load balancer
    sends new connections elsewhere, and lets open requests finish), its websockets and event
    streams are told `going_away` and closed, so that their clients reconnect to another node
    and resume at once, instead of holding the worker until its graceful timeout."""
    import signal
    import threading

    stop = signal.getsignal(signal.SIGTERM)
    app = worker.wsgi

    def on_stop(signum: int, frame: Any) -> None:
        if callable(stop):
            stop(signum, frame)
        # Not in the signal handler: it may have interrupted a holder of the hub's lock (and
        # under gevent it runs in the event loop, where nothing may wait).
        going_away = app.extensions["logfold.hub"].going_away
        if app.extensions["logfold.settings"].api_worker == "gevent":
            import gevent

            gevent.spawn(going_away)
        else:
            threading.Thread(target=going_away, daemon=True).start()

    signal.signal(signal.SIGTERM, on_stop)


def cooperative() -> None:
    """Under gevent, make sure nothing blocks the worker's one thread: kafka-python's clients
    take their selector from a default captured when `kafka` was first imported (here, maybe
    before the patching, in gunicorn's master): point it at the patched one. psycopg chooses how
    it waits when first imported: refuse to serve if it chose its C wait, which would hold every
    greenlet during each query."""
    import selectors

    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.client_async import KafkaClient
    from kafka.conn import BrokerConnection

    for client in (KafkaAdminClient, KafkaConsumer, KafkaProducer, KafkaClient, BrokerConnection):
        client.DEFAULT_CONFIG["selector"] = selectors.DefaultSelector

    import psycopg.waiting

    if getattr(psycopg.waiting.wait, "__name__", "") == "wait_c":
        raise RuntimeError(
            "psycopg was imported before gevent patched the process, so its queries would "
            "block the gevent worker; start the API with `logfold api` (which imports it only "
            "in the worker)"
        )


def _raise_open_files(wanted: int) -> None:
    """Each connection is a file descriptor: raise the soft limit towards `wanted` (never past
    the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
