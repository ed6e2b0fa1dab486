"""The Flask application: REST routes, auth, error mapping, OpenAPI.

`create_app(settings)` is the one place the API is wired; tests pass their own collaborators."""

from __future__ import annotations

from typing import Any

from flask import Flask

from app import commands_api, errors, live_page, ops, views_api, ws_api
from app.health import HealthChecks
from app.live import Hub
from app.metrics import Metrics
from app.openapi import build_spec
from app.read_model import ReadModel
from commands.bus import CommandBus
from projections.registry import CAPTURED
from stack.settings import Settings
from stack.topics import Topics


def create_app(settings: Settings, **overrides: Any) -> Flask:
    if not settings.jwt_secret:
        raise RuntimeError("LOGFOLD_JWT_SECRET is not set; the API cannot verify tokens")
    app = Flask("logfold")
    app.config.update(
        JWT_SECRET=settings.jwt_secret,
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RETRY_AFTER_S=settings.retry_after_s,
    )
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["logfold.settings"] = settings
    app.extensions["logfold.bus"] = overrides.get("bus") or CommandBus(settings)
    read_model = overrides.get("read_model") or ReadModel(settings)
    app.extensions["logfold.read_model"] = read_model
    app.extensions["logfold.health"] = overrides.get("health") or HealthChecks(settings, read_model)
    app.extensions["logfold.metrics"] = Metrics()
    app.extensions["logfold.openapi"] = build_spec()
    topics = Topics(settings.topic_prefix)
    app.extensions["logfold.hub"] = overrides.get("hub") or Hub(
        settings.kafka(), {t: topics.cdc(t) for t in CAPTURED}, settings.ws_replay
    )
    app.config["SOCK_SERVER_OPTIONS"] = {"max_message_size": settings.ws_max_message_bytes}
    errors.register(app)
    app.register_blueprint(ops.bp)
    app.register_blueprint(commands_api.bp)
    app.register_blueprint(views_api.bp)
    app.register_blueprint(ws_api.bp)
    app.register_blueprint(live_page.bp)
    return app
