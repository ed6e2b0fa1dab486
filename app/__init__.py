"""The Flask application: REST routes, auth, error mapping, OpenAPI.

`create_app(settings)` is the one place the API is wired; tests pass their own collaborators.
`close_app(app)` stops what it started (Kafka clients, the websocket hub, the health checks)."""

from __future__ import annotations

from typing import Any

from flask import Flask

from app import (
    asyncapi,
    commands_api,
    dead_letters_api,
    errors,
    feeds_api,
    live_page,
    ops,
    streams_api,
    views_api,
    webhooks_api,
    ws_admission,
    ws_api,
    ws_writer,
)
from app.auth import check_secret
from app.health import HealthChecks, HealthMonitor
from app.hub import Hub
from app.metrics import Metrics
from app.openapi import build_spec
from app.read_model import ReadModel
from commands.bus import CommandBus
from config.settings import Settings
from config.topics import Topics
from projections.registry import CAPTURED
from streams.ingest import Ingestion


def create_app(settings: Settings, **overrides: Any) -> Flask:
    check_secret(settings.jwt_secret)  # anyone who knows the secret can mint an admin token
    app = Flask("logfold")
    app.config.update(
        JWT_SECRET=settings.jwt_secret,
        JWT_AUDIENCE=settings.jwt_audience,
        JWT_MAX_TTL_S=settings.jwt_max_ttl_s,
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RETRY_AFTER_S=settings.retry_after_s,
    )
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["logfold.settings"] = settings
    app.extensions["logfold.bus"] = overrides.get("bus") or CommandBus(settings)
    app.extensions["logfold.ingestion"] = overrides.get("ingestion") or Ingestion(settings)
    read_model = overrides.get("read_model") or ReadModel(settings)
    app.extensions["logfold.read_model"] = read_model
    topics = Topics(settings.topic_prefix)
    hub = overrides.get("hub") or Hub(
        settings.kafka(), {t: topics.cdc(t) for t in CAPTURED}, settings.ws_replay
    )
    app.extensions["logfold.hub"] = hub
    app.extensions["logfold.health"] = overrides.get("health") or HealthMonitor(
        HealthChecks(settings, read_model, timeout=settings.health_timeout_s, hub=hub),
        interval=settings.health_interval_s,
        failures=settings.health_failures,
    )
    app.extensions["logfold.metrics"] = Metrics()
    app.extensions["logfold.openapi"] = build_spec()
    app.config["SOCK_SERVER_OPTIONS"] = {
        "max_message_size": settings.ws_max_message_bytes,
        # Each connection's handler reads its own socket: no reader thread, nothing to signal.
        "thread_class": ws_api.Unthreaded,
        "event_class": ws_api.Unsignalled,
    }
    app.extensions["logfold.ws_writer"] = ws_writer.Writer(settings.ws_heartbeat_s)
    app.extensions["logfold.ws_admission"] = ws_admission.Admission(
        settings.ws_max_open,
        settings.ws_max_per_subject,
        settings.ws_max_pending,
        settings.ws_max_pending_per_address,
    )
    errors.register(app)
    app.register_blueprint(ops.bp)
    app.register_blueprint(asyncapi.bp)
    app.register_blueprint(commands_api.bp)
    app.register_blueprint(streams_api.bp)
    app.register_blueprint(feeds_api.bp)  # before views': `/views/<v>/events` is not a key
    app.register_blueprint(views_api.bp)
    app.register_blueprint(webhooks_api.bp)
    app.register_blueprint(dead_letters_api.bp)
    app.register_blueprint(ws_api.bp)
    app.register_blueprint(live_page.bp)
    return app


def close_app(app: Flask) -> None:
    app.extensions["logfold.health"].stop()
    app.extensions["logfold.hub"].stop()
    app.extensions["logfold.ws_writer"].stop()
    app.extensions["logfold.bus"].close()
    app.extensions["logfold.ingestion"].close()
    app.extensions["logfold.read_model"].close()
