"""`GET /live`: a small page that subscribes to one view over `/ws` and keeps its rows current
(app/static/live.html, live.js, live.css; plain files, no build step).

Loading it needs no token: the page takes one from the user or from the URL fragment
(`/live#token=…`), which browsers never send to the server, so tokens stay out of access logs."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

from app.errors import ApiError

bp = Blueprint("live_page", __name__)

STATIC = Path(__file__).parent / "static"
ASSETS = frozenset({"live.js", "live.css"})

# The page loads only its own files and talks only to its own origin ('self' covers ws/wss).
HEADERS = {
    "Content-Security-Policy": "; ".join(
        [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


@bp.get("/live")
def page() -> Response:
    return _send("live.html")


@bp.get("/live/<name>")
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise ApiError(404, "not_found", f"no file {name!r} under /live")
    return _send(name)


def _send(name: str) -> Response:
    response = send_from_directory(STATIC, name)
    response.headers.update(HEADERS)
    return response
