"""Operational endpoints: health, metrics, the OpenAPI document and its human view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, send_from_directory
from swagger_ui_bundle import swagger_ui_path

from app.auth import has_scope, require
from app.health import public

bp = Blueprint("ops", __name__)

DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Logfold API</title>
<link rel="stylesheet" href="/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>"""


# A process that has just started answers /health once its first round of checks is in, or
# after this long (then its components read "not checked yet").
FIRST_ROUND_WAIT_S = 10.0


@bp.get("/health")
def health() -> Response:
    """Readiness: the background checks' last results; no check runs for the request."""
    components = _components()
    metrics = current_app.extensions["logfold.metrics"]
    metrics.record_health(components)
    up = all(c["status"] == "up" for c in components.values())
    shown = components if has_scope("admin") else public(components)
    response = jsonify({"status": "up" if up else "down", "components": shown})
    response.status_code = 200 if up else 503
    if not up:
        response.headers["Retry-After"] = str(current_app.config["RETRY_AFTER_S"])
    return response


def _components() -> dict[str, Any]:
    monitor = current_app.extensions["logfold.health"]
    monitor.start()  # at the first request that asks; then it runs on its own
    components: dict[str, Any] = monitor.snapshot(wait=FIRST_ROUND_WAIT_S)
    return components


@bp.get("/health/live")
def live() -> Response:
    """Liveness: the process serves requests. Dependencies are readiness's business."""
    return jsonify({"status": "up"})


@bp.get("/metrics")
@require("admin")
def metrics() -> Response:
    metrics = current_app.extensions["logfold.metrics"]
    metrics.record_health(
        current_app.extensions["logfold.health"].snapshot(wait=FIRST_ROUND_WAIT_S)
    )
    body = metrics.render()
    return Response(body, mimetype="text/plain; version=0.0.4")


@bp.get("/openapi.json")
def openapi() -> Response:
    return jsonify(current_app.extensions["logfold.openapi"])


@bp.get("/docs")
def docs() -> Response:
    return Response(DOCS_PAGE, mimetype="text/html")


@bp.get("/docs/static/<path:filename>")
def docs_static(filename: str) -> Response:
    return send_from_directory(Path(swagger_ui_path), filename)
