"""Every error leaves the API as `{"error": {"code", "message", "details"}}` (docs/api.md)."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import psycopg
from flask import Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    410: "gone",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_failed",
    429: "too_many_requests",
    503: "unavailable",
    504: "timeout",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: list[Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = details or []
        self.headers = headers or {}


def error_response(
    status: int,
    code: str,
    message: str,
    details: list[Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    response = jsonify({"error": {"code": code, "message": message, "details": details or []}})
    response.status_code = status
    response.headers.update(headers or {})
    return response


def json_body() -> Any:
    """The request's body as JSON: `415` unless it says it is JSON, `400` unless it is."""
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the body as application/json")
    try:
        return json.loads(request.get_data(cache=False))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {e}") from e


def json_object() -> dict[str, Any]:
    """`json_body()`, which must be a JSON object (`422` otherwise)."""
    body = json_body()
    if not isinstance(body, dict):
        raise ApiError(
            422,
            "validation_failed",
            "the body must be a JSON object",
            [{"field": "", "problem": "expected an object"}],
        )
    return body


def unavailable(message: str, cause: BaseException | None = None) -> ApiError:
    """A `503` telling the client when to try again (`Retry-After`). `cause`'s text, which can
    name hosts, ports and internals, goes to the log, never to the client."""
    if cause is not None:
        log.warning("%s [%s: %s]", message, type(cause).__name__, cause)
    retry = str(current_app.config["RETRY_AFTER_S"])
    return ApiError(503, "unavailable", message, headers={"Retry-After": retry})


def too_many(message: str, retry_after_s: float = 1.0) -> ApiError:
    """A `429`: the request was fine, but this client has too many under way; try again."""
    return ApiError(
        429,
        "too_many_requests",
        message,
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )


def register(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(e: ApiError) -> Response:
        return error_response(e.status, e.code, e.message, e.details, e.headers)

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        message = e.description or e.name
        if status == 413:
            message = f"the body is larger than {request.max_content_length} bytes"
        response = error_response(status, HTTP_CODES.get(status, "error"), message)
        if status == 405 and e.get_response().headers.get("Allow"):
            response.headers["Allow"] = e.get_response().headers["Allow"]
        return response

    @app.errorhandler(Exception)
    def _unexpected(e: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(500, "internal", "unexpected server error; it has been logged")


def database_unavailable(fn: Any) -> Any:
    """Route decorator: Postgres away is `503` with Retry-After, never a hang or a `500`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except psycopg.OperationalError as e:
            raise unavailable("the database is unavailable; try again", e) from e

    return wrapper
