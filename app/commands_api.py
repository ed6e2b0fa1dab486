"""`POST /commands/<name>`: parse, validate, hand to command processing, map the outcome."""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from pydantic import ValidationError

from app.auth import require
from app.errors import ApiError, json_object, unavailable
from commands.bus import CommandBus, ReplyTimeout, Unavailable
from commands.registry import COMMANDS, CommandSpec
from commands.schemas import CommandRequest, details

bp = Blueprint("commands", __name__)

IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1b1c2e-3d0e-4d57-9a55-4c0f1d7e2a10")
# An X-Correlation-Id is kept in every event of the command, for ever: 1 to 128 visible ASCII
# characters (no spaces, control or non-ASCII characters to forge log lines or break readers).
CORRELATION_ID = re.compile(r"[\x21-\x7e]{1,128}")


def _scope(name: str) -> str:
    """The scope a command needs (`commands:write`, or its own: `erase-customer`'s `admin`)."""
    spec = COMMANDS.get(name)
    return spec.command_type.scope if spec is not None else "commands:write"


@bp.post("/commands/<name>")
@require(_scope)
def post_command(name: str) -> Response:
    spec = COMMANDS.get(name)
    if spec is None:
        raise ApiError(404, "not_found", f"unknown command {name!r}; see /openapi.json")
    body = json_object()
    req, data = _validate(spec, body)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 128:
        raise ApiError(
            422,
            "validation_failed",
            "invalid Idempotency-Key",
            [{"field": "Idempotency-Key", "problem": "must be 1 to 128 characters"}],
        )
    correlation_id = request.headers.get("X-Correlation-Id") or str(uuid.uuid4())
    if not CORRELATION_ID.fullmatch(correlation_id):
        raise ApiError(
            422,
            "validation_failed",
            "invalid X-Correlation-Id",
            [
                {
                    "field": "X-Correlation-Id",
                    "problem": "must be 1 to 128 visible ASCII characters (no spaces)",
                }
            ],
        )
    aggregate_id = req.aggregate_id or _new_aggregate_id(spec, key)
    # Only a retry under the same key is compared with it.
    fingerprint = (
        _fingerprint(name, req.aggregate_id, req.expected_version, data)
        if key is not None
        else None
    )
    bus: CommandBus = current_app.extensions["logfold.bus"]
    msg = bus.new_message(
        command_id=str(uuid.uuid4()),
        name=name,
        aggregate_type=spec.aggregate.name,
        aggregate_id=aggregate_id,
        expected_version=req.expected_version,
        data=data,
        correlation_id=correlation_id,
        subject=g.subject,
        idempotency_key=(
            f"{g.subject}|{spec.aggregate.name}|{aggregate_id}|{key}" if key is not None else None
        ),
        fingerprint=fingerprint,
    )
    metrics = current_app.extensions["logfold.metrics"]
    started = time.perf_counter()
    try:
        reply = bus.submit(msg)
    except Unavailable as e:
        metrics.count(name, 503)
        raise unavailable(
            "Kafka is unavailable; nothing was written. Retry after Retry-After seconds "
            "(with the same Idempotency-Key, if it had one).",
            e,
        ) from e
    except ReplyTimeout as e:
        metrics.count(name, 504)
        raise ApiError(
            504,
            "timeout",
            (
                "no outcome in time; a command not committed by its deadline expires and is "
                "never applied later, unless its commit, asked for in time, was held up in "
                "Kafka (an unresponsive broker may complete it when it recovers). "
                "Retry with the same Idempotency-Key to learn the outcome safely."
            ),
        ) from e
    finally:
        metrics.observe(name, time.perf_counter() - started)
    response = jsonify(reply.body)
    response.status_code = reply.status
    if reply.replay:
        response.headers["Idempotent-Replay"] = "true"
    if reply.status == 503:  # the processor could not reach the subjects' keys (Postgres)
        response.headers["Retry-After"] = str(current_app.config["RETRY_AFTER_S"])
    metrics.count(name, reply.status)
    return response


def _validate(spec: CommandSpec, body: dict[str, Any]) -> tuple[CommandRequest, dict[str, Any]]:
    problems: list[dict[str, str]] = []
    req: CommandRequest | None = None
    try:
        req = CommandRequest.model_validate(body)
    except ValidationError as e:
        problems += details(e)
    data = body.get("data", {})
    if isinstance(data, dict):
        try:
            data = spec.schema.model_validate(data).model_dump(mode="json")
        except ValidationError as e:
            problems += details(e, prefix=("data",))
    if req is not None and req.aggregate_id is None and not spec.creates:
        problems.append({"field": "aggregate_id", "problem": f"required for {spec.name}"})
    if problems or req is None:
        raise ApiError(422, "validation_failed", f"invalid {spec.name} command", problems)
    return req, data


def _new_aggregate_id(spec: CommandSpec, key: str | None) -> str:
    """A retried creating command with the same Idempotency-Key must reach the same aggregate."""
    if key is None:
        return str(uuid.uuid4())
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{g.subject}|{spec.name}|{key}"))


def _fingerprint(name: str, aggregate_id: str | None, expected: int | None, data: Any) -> str:
    doc = {"name": name, "aggregate_id": aggregate_id, "expected_version": expected, "data": data}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
