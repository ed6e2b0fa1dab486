"""Serving the API with gunicorn (threaded workers, which flask-sock's websockets need)."""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from config.logs import is_debug
from config.settings import Settings


class ApiServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings, workers: int = 1) -> None:
        self.settings = settings
        self.options = {
            "bind": f"{settings.api_host}:{settings.api_port}",
            "worker_class": "gthread",
            "workers": workers,
            "threads": settings.api_threads,
            # Each open websocket holds a thread, up to `ws_max_open`; the reserved threads serve
            # plain requests. Accept more connections than that, so the ones that must be
            # refused (server full) are answered at once instead of waiting in the backlog.
            "worker_connections": settings.api_threads * 2 + 100,
            "timeout": 60,
            "graceful_timeout": 10,
            "accesslog": None,
            "loglevel": "info" if is_debug(settings.log_level) else "warning",
        }
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        # Runs in each worker after the fork, so Kafka clients and threads belong to it.
        import faulthandler
        import signal

        from app import create_app

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: thread dump

        return create_app(self.settings)
