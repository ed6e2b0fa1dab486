"""Operational endpoints: health, metrics, the OpenAPI document and its human view."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, current_app, jsonify, send_from_directory
from swagger_ui_bundle import swagger_ui_path

from app.auth import require

bp = Blueprint("ops", __name__)

DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Logfold API</title>
<link rel="stylesheet" href="/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>"""


@bp.get("/health")
def health() -> Response:
    components = current_app.extensions["logfold.health"].run()
    metrics = current_app.extensions["logfold.metrics"]
    metrics.record_health(components)
    up = all(c["status"] == "up" for c in components.values())
    response = jsonify({"status": "up" if up else "down", "components": components})
    response.status_code = 200 if up else 503
    if not up:
        response.headers["Retry-After"] = str(current_app.config["RETRY_AFTER_S"])
    return response


@bp.get("/metrics")
@require("admin")
def metrics() -> Response:
    metrics = current_app.extensions["logfold.metrics"]
    metrics.record_health(current_app.extensions["logfold.health"].run())
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
