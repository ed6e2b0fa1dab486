"""`POST /streams/<stream>/records`: validate a batch of facts, commit it whole, answer `202`."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from flask import Blueprint, Response, current_app, jsonify, request
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from app.auth import require
from app.errors import ApiError, json_object, unavailable
from commands.schemas import details
from streams.ingest import FactRecord, Ingestion, Unavailable, Unknown
from streams.registry import STREAMS, Stream

bp = Blueprint("streams", __name__)
log = logging.getLogger(__name__)

MAX_RECORDS = 1000
MAX_BYTES = 1024 * 1024


def _text(value: object) -> object:
    if not isinstance(value, str):
        raise ValueError("must be an ISO-8601 date-time with a zone, e.g. 2026-11-23T10:00:00Z")
    return value


def _utc(value: datetime) -> datetime:
    """The time in UTC, as the record carries it; one that UTC cannot hold (year 1 east of
    Greenwich, year 9999 west of it) is invalid, not a crash."""
    try:
        return value.astimezone(UTC)
    except OverflowError as e:
        raise ValueError("is out of range: in UTC it must fall within the years 1 to 9999") from e


class RecordIn(BaseModel):
    """One record of `POST /streams/<stream>/records`; `data` is checked against the stream's
    own model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]
    # ISO-8601 with a zone offset; a number would pass as a Unix time without the text check.
    occurred_at: Annotated[
        AwareDatetime, Field(strict=False), BeforeValidator(_text), AfterValidator(_utc)
    ]
    data: dict[str, object]


class RecordsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    records: Annotated[list[dict[str, object]], Field(min_length=1, max_length=MAX_RECORDS)]


@bp.post("/streams/<name>/records")
@require("streams:write")
def post_records(name: str) -> Response:
    stream = STREAMS.get(name)
    if stream is None:
        raise ApiError(404, "not_found", f"unknown stream {name!r}; see /openapi.json")
    request.max_content_length = MAX_BYTES
    records = _validate(stream, json_object(), datetime.now(UTC))
    ingestion: Ingestion = current_app.extensions["logfold.ingestion"]
    try:
        ingestion.append(stream, records)
    except Unavailable as e:
        raise unavailable(
            "Kafka is unavailable; the records were not accepted. Retry the same request "
            "after Retry-After seconds: a record's id makes a retry harmless.",
            e,
        ) from e
    except Unknown as e:
        log.warning("stream %s: a commit not acknowledged in time [%s]", name, e)
        raise ApiError(
            504,
            "timeout",
            "Kafka did not acknowledge the commit in time; the records may or may not be "
            "accepted. Retry the same request: a record's id makes a retry harmless.",
        ) from e
    response = jsonify({"accepted": len(records)})
    response.status_code = 202
    return response


def _validate(stream: Stream, body: dict[str, Any], now: datetime) -> list[FactRecord]:
    """Every record valid, or `422` listing each problem (`records.<index>.<field>`)."""
    try:
        raw = RecordsIn.model_validate(body).records
    except ValidationError as e:
        bad = details(e)
        raise ApiError(422, "validation_failed", f"invalid {stream.name} request", bad) from e
    skew = timedelta(seconds=current_app.extensions["logfold.settings"].clock_skew_s)
    received_at = _iso(now)
    problems: list[dict[str, str]] = []
    records: list[FactRecord] = []
    for i, doc in enumerate(raw):
        at = ("records", str(i))
        try:
            record = RecordIn.model_validate(doc)
        except ValidationError as e:
            problems += details(e, prefix=at)
            continue
        try:
            data = stream.schema.model_validate(record.data).model_dump(mode="json")
        except ValidationError as e:
            problems += details(e, prefix=(*at, "data"))
            continue
        if record.occurred_at > now + skew:
            problems.append(
                {
                    "field": ".".join((*at, "occurred_at")),
                    "problem": f"is in the future (more than {skew.total_seconds():g} s "
                    "ahead of the server's clock)",
                }
            )
            continue
        records.append(FactRecord(record.id, _iso(record.occurred_at), received_at, data))
    if problems:
        raise ApiError(422, "validation_failed", f"invalid {stream.name} records", problems)
    return records


def _iso(at: datetime) -> str:
    """UTC, millisecond precision, `Z`: the one spelling of a time on the wire."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
