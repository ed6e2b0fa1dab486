"""The OpenAPI document, generated from the same pydantic models that validate commands."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.dead_letters_api import MAX_LIMIT as DEAD_LIMIT
from app.dead_letters_api import MAX_REASON
from app.feeds_api import MAX_LIMIT as CHANGES_LIMIT
from app.streams_api import MAX_BYTES, MAX_RECORDS
from app.views_api import MAX_LIMIT, MAX_WAIT_S
from app.webhooks_api import MAX_LIMIT as DELIVERIES_LIMIT
from app.webhooks_api import MAX_URL, STATUSES
from commands.registry import COMMANDS
from commands.schemas import CommandRequest
from projections.registry import PROJECTIONS, VIEWS
from streams.registry import STREAMS

ERRORS = {
    "400": "malformed_json",
    "401": "unauthorized",
    "403": "forbidden",
    "404": "not_found",
    "409": "version_conflict or rule_violated",
    "410": "gone (the aggregate was erased)",
    "413": "payload_too_large",
    "415": "unsupported_media_type",
    "422": "validation_failed or idempotency_key_reused",
    "429": "too_many_requests (see Retry-After)",
    "503": "unavailable (see Retry-After)",
    "504": "timeout",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_spec() -> dict[str, Any]:
    models: list[type[BaseModel]] = [
        CommandRequest,
        *(s.schema for s in COMMANDS.values()),
        *(s.schema for s in STREAMS.values()),
    ]
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    schemas["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message", "details"],
                "properties": {
                    "code": {"type": "string"},
                    "message": {"type": "string"},
                    "details": {"type": "array", "items": {}},
                },
            }
        },
    }
    schemas["CommandAccepted"] = {
        "type": "object",
        "required": ["aggregate_type", "aggregate_id", "version", "events", "position"],
        "properties": {
            "aggregate_type": {"type": "string"},
            "aggregate_id": {"type": "string"},
            "version": {"type": "integer"},
            "position": {"type": "string"},
            "events": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "event_id": {"type": "string"},
                        "type": {"type": "string"},
                        "version": {"type": "integer"},
                    },
                },
            },
        },
    }
    errors = {
        code: {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code, text in ERRORS.items()
    }
    paths: dict[str, Any] = {}
    for spec in COMMANDS.values():
        body: dict[str, Any] = {
            "allOf": [_ref(CommandRequest)],
            "properties": {"data": _ref(spec.schema)},
        }
        if not spec.creates:  # the API answers 422 without it
            body["properties"]["aggregate_id"] = {"type": "string"}
            body["required"] = ["aggregate_id"]
        paths[f"/commands/{spec.name}"] = {
            "post": {
                "summary": spec.summary,
                "operationId": spec.name.replace("-", "_"),
                "tags": [spec.aggregate.name],
                "security": [{"bearer": [spec.command_type.scope]}],
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string", "maxLength": 128},
                    }
                ],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                },
                "responses": {
                    "201": {
                        "description": "events committed",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/CommandAccepted"}
                            }
                        },
                    },
                    "200": {"description": "idempotent replay of the first response"},
                    **errors,
                },
            }
        }
    paths.update(stream_paths(errors))
    paths.update(view_paths(errors))
    paths.update(webhook_paths(errors))
    paths.update(dead_letter_paths(errors))
    paths.update(operations_paths(errors))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Logfold",
            "version": "0.1.0",
            "description": "Commands in, events to Kafka, views out. See docs/api.md.",
        },
        "security": [{"bearer": []}],
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}
            },
        },
        "paths": paths,
    }


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _pick(errors: dict[str, Any], *codes: str) -> dict[str, Any]:
    return {code: errors[code] for code in codes}


def _column_schema(python_type: type) -> dict[str, Any]:
    """A view column's value as the API writes it (timestamps as ISO-8601 UTC strings)."""
    if python_type is bool:
        return {"type": "boolean"}
    if python_type is int:
        return {"type": "integer"}
    if python_type is float:
        return {"type": "number"}
    if python_type.__name__ == "datetime":
        return {"type": "string", "format": "date-time"}
    if python_type.__name__ == "date":
        return {"type": "string", "format": "date"}
    return {"type": "string"}


# A view change, as every protocol carries it (websocket, server-sent events, long-polling).
CHANGE = {
    "type": "object",
    "required": ["type", "id", "op", "key", "row", "position"],
    "properties": {
        "type": {"const": "change"},
        "id": {"type": "string"},
        "op": {"enum": ["upsert", "delete"]},
        "key": {"type": "object"},
        "row": {"type": ["object", "null"]},
        "position": {"type": "string"},
    },
}

CONSISTENCY = [
    {
        "name": "consistent_with",
        "in": "query",
        "required": False,
        "description": "a command's `position`: answer once the view includes it",
        "schema": {"type": "string", "maxLength": 200},
    },
    {
        "name": "wait",
        "in": "query",
        "required": False,
        "description": "seconds to wait for `consistent_with` (default 5)",
        "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
    },
    {
        "name": "X-Consistent-With",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "maxLength": 200},
    },
]


def stream_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """`POST /streams/<stream>/records` of every declared stream."""
    paths: dict[str, Any] = {}
    for stream in STREAMS.values():
        record = {
            "type": "object",
            "required": ["id", "occurred_at", "data"],
            "additionalProperties": False,
            "properties": {
                "id": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 128,
                    "description": "the record's identity: a retry with the same id is harmless",
                },
                "occurred_at": {
                    "type": "string",
                    "format": "date-time",
                    "description": "event time (the device's clock), with a zone",
                },
                "data": _ref(stream.schema),
            },
        }
        body = {
            "type": "object",
            "required": ["records"],
            "additionalProperties": False,
            "properties": {
                "records": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_RECORDS,
                    "items": record,
                }
            },
        }
        paths[f"/streams/{stream.name}/records"] = {
            "post": {
                "summary": f"{stream.summary} (at most {MAX_RECORDS} records, {MAX_BYTES} bytes)",
                "operationId": f"ingest_{stream.name}",
                "tags": ["streams"],
                "security": [{"bearer": ["streams:write"]}],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                },
                "responses": {
                    "202": _json(
                        {
                            "type": "object",
                            "required": ["accepted"],
                            "properties": {"accepted": {"type": "integer"}},
                        },
                        "every record of the request is committed in Kafka",
                    ),
                    **_pick(errors, "400", "401", "403", "404", "413", "415", "422", "503", "504"),
                },
            }
        }
    return paths


def view_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """`GET /views`, and for every view its rows (filters, paging, read-your-writes) and one row
    by key. A token's row claim narrows every one of them (docs/api.md, Auth)."""
    failures = _pick(errors, "401", "403", "404", "422", "429", "503", "504")
    paths: dict[str, Any] = {
        "/views": {
            "get": {
                "summary": "The views, with their key, filterable columns and lag",
                "operationId": "list_views",
                "tags": ["views"],
                "security": [{"bearer": ["views:read"]}],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["views"],
                            "properties": {"views": {"type": "array", "items": {"type": "object"}}},
                        },
                        "every view",
                    ),
                    **_pick(errors, "401", "403", "503"),
                },
            }
        }
    }
    for name, (_, view) in VIEWS.items():
        columns = {c.name: _column_schema(c.type.python_type) for c in view.table.columns}
        row = {"type": "object", "properties": columns}
        filters = [
            {"name": c, "in": "query", "required": False, "schema": columns[c]}
            for c in view.filterable
        ]
        key = ",".join(view.key)
        paths[f"/views/{name}"] = {
            "get": {
                "summary": f"Rows of {name}, in key order",
                "operationId": f"list_{name}",
                "tags": ["views"],
                "security": [{"bearer": ["views:read"]}],
                "parameters": [
                    *filters,
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                    },
                    {
                        "name": "cursor",
                        "in": "query",
                        "required": False,
                        "description": "`next` of the previous page",
                        "schema": {"type": "string"},
                    },
                    *CONSISTENCY,
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["rows", "next"],
                            "properties": {
                                "rows": {"type": "array", "items": row},
                                "next": {"type": ["string", "null"]},
                            },
                        },
                        "a page of rows",
                    ),
                    **failures,
                },
            }
        }
        paths[f"/views/{name}/changes"] = {
            "get": {
                "summary": f"Long-poll {name}: a snapshot, then the changes after a position",
                "description": (
                    "Without `since`: the rows (a consistent snapshot) and its position as "
                    "`next`. With `since`: every change after it, in order (at most `limit`), "
                    "waiting up to `wait` seconds for the first, and `next` to ask from; "
                    '`{"resync": true}` when `since` can no longer be served (ask again '
                    "without it). The same changes as a websocket's (see /asyncapi.json)."
                ),
                "operationId": f"changes_{name}",
                "tags": ["views"],
                "security": [{"bearer": ["views:read"]}],
                "parameters": [
                    *filters,
                    {
                        "name": "since",
                        "in": "query",
                        "required": False,
                        "description": "`next` of the previous answer",
                        "schema": {"type": "string", "maxLength": 4096},
                    },
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "description": "seconds to wait for a first change (default 0), or "
                        "for `consistent_with` without `since` (default 5)",
                        "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": CHANGES_LIMIT},
                    },
                    CONSISTENCY[0],
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["changes", "next"],
                            "properties": {
                                "snapshot": {"type": "array", "items": row},
                                "changes": {"type": "array", "items": CHANGE},
                                "next": {"type": ["string", "null"]},
                                "resync": {"type": "boolean"},
                            },
                        },
                        "a snapshot, or a page of changes",
                    ),
                    **failures,
                },
            }
        }
        paths[f"/views/{name}/{{key}}"] = {
            "get": {
                "summary": f"One row of {name} by its key ({key}, joined with `,`)",
                "operationId": f"get_{name}",
                "tags": ["views"],
                "security": [{"bearer": ["views:read"]}],
                "parameters": [
                    {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}},
                    *CONSISTENCY,
                ],
                "responses": {"200": _json(row, "the row"), **failures},
            }
        }
    return paths


WEBHOOK = {
    "type": "object",
    "required": [
        "id",
        "url",
        "view",
        "filter",
        "status",
        "paused_reason",
        "cursor",
        "failing_since",
        "last_error",
        "attempts",
        "dead_letters",
        "skipped_offsets",
        "created_at",
        "updated_at",
    ],
    "properties": {
        "id": {"type": "string"},
        "url": {"type": "string"},
        "view": {"type": "string"},
        "filter": {"type": "object"},
        "status": {"enum": ["active", "paused"]},
        "paused_reason": {"type": ["string", "null"]},
        "cursor": {
            "type": "integer",
            "description": "the next offset of the view's changelog to look at",
        },
        "failing_since": {"type": ["string", "null"], "format": "date-time"},
        "last_error": {"type": ["string", "null"]},
        "attempts": {"type": "integer", "description": "of the delivery being retried"},
        "dead_letters": {"type": "integer", "description": "failed ones"},
        "skipped_offsets": {
            "type": "integer",
            "description": "changelog offsets compaction removed before the cursor reached them",
        },
        "created_at": {"type": "string", "format": "date-time"},
        "updated_at": {"type": "string", "format": "date-time"},
    },
}

DEAD_LETTER = {
    "type": "object",
    "required": [
        "id",
        "offset",
        "position",
        "key",
        "body",
        "attempts",
        "last_error",
        "first_attempt_at",
        "failed_at",
        "status",
        "replayed_at",
    ],
    "properties": {
        "id": {"type": "string", "description": "the delivery's `webhook-id`"},
        "offset": {"type": "integer"},
        "position": {"type": "string"},
        "key": {"type": "object"},
        "body": {"type": "string"},
        "attempts": {"type": "integer"},
        "last_error": {"type": "string"},
        "first_attempt_at": {"type": "string", "format": "date-time"},
        "failed_at": {"type": "string", "format": "date-time"},
        "status": {"enum": list(STATUSES)},
        "replayed_at": {"type": ["string", "null"], "format": "date-time"},
    },
}


LETTER = {
    "type": "object",
    "properties": {
        "projection": {"type": "string"},
        "topic": {"type": "string"},
        "partition": {"type": "integer"},
        "offset": {"type": "integer"},
        "aggregate": {"type": "string", "description": "aggregate id (a stream's: its key)"},
        "error": {"type": "string", "description": "why it is parked: its error, or whose"},
        "parked_at": {"type": "string", "format": "date-time"},
        "retry_requested": {"type": "boolean"},
        "skip_reason": {"type": ["string", "null"]},
    },
}


def dead_letter_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """`/dead-letters…` (scope `admin`): the projections' parked events (guarantee 26;
    docs/operations.md, Dead letters)."""
    security = [{"bearer": ["admin"]}]
    name = {
        "name": "projection",
        "in": "path",
        "required": True,
        "schema": {"enum": sorted(PROJECTIONS)},
    }
    text = {"type": "string", "minLength": 1, "maxLength": MAX_REASON}
    asked = {
        "type": "object",
        "properties": {
            "projection": {"type": "string"},
            "retry_requested": {"type": "integer"},
            "skip_requested": {"type": "integer"},
        },
    }
    summary = {
        "type": "object",
        "properties": {
            "projections": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "projection": {"type": "string"},
                        "parked_events": {"type": "integer"},
                        "parked_aggregates": {"type": "integer"},
                        "skipped_events": {"type": "integer"},
                        "first_error": {"type": ["string", "null"]},
                    },
                },
            }
        },
    }
    return {
        "/dead-letters": {
            "get": {
                "summary": "Each projection's parked and skipped events",
                "operationId": "dead_letters",
                "tags": ["dead letters"],
                "security": security,
                "responses": {
                    "200": _json(summary, "every projection's counts"),
                    **_pick(errors, "401", "403", "503"),
                },
            }
        },
        "/dead-letters/{projection}": {
            "get": {
                "summary": "A projection's parked (or skipped) events, in log order",
                "operationId": "dead_letter_events",
                "tags": ["dead letters"],
                "security": security,
                "parameters": [
                    name,
                    {"name": "aggregate", "in": "query", "schema": {"type": "string"}},
                    {"name": "skipped", "in": "query", "schema": {"enum": ["true", "false"]}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": DEAD_LIMIT},
                    },
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "properties": {
                                "projection": {"type": "string"},
                                "events": {"type": "array", "items": LETTER},
                            },
                        },
                        "the events",
                    ),
                    **_pick(errors, "401", "403", "404", "422", "503"),
                },
            }
        },
        "/dead-letters/{projection}/retry": {
            "post": {
                "summary": "Ask the projector to apply the parked events again, in order",
                "operationId": "retry_dead_letters",
                "tags": ["dead letters"],
                "security": security,
                "parameters": [name],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"aggregate": text},
                            }
                        }
                    },
                },
                "responses": {
                    "202": _json(asked, "asked for; the projector applies them"),
                    **_pick(errors, "400", "401", "403", "404", "415", "422", "503"),
                },
            }
        },
        "/dead-letters/{projection}/skip": {
            "post": {
                "summary": "Ask the projector to skip an aggregate's failed event, on record",
                "operationId": "skip_dead_letters",
                "tags": ["dead letters"],
                "security": security,
                "parameters": [name],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["aggregate", "reason"],
                                "additionalProperties": False,
                                "properties": {
                                    "aggregate": text,
                                    "reason": text,
                                    "every": {
                                        "type": "boolean",
                                        "description": "every parked event of the aggregate, "
                                        "not only the first (the one that failed)",
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "202": _json(asked, "asked for; the rest of the aggregate is retried"),
                    **_pick(errors, "400", "401", "403", "404", "415", "422", "503"),
                },
            }
        },
    }


def webhook_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """`/webhooks…` (scope `admin`): webhook endpoints and their dead letters (docs/api.md,
    Webhooks; docs/webhooks.md)."""
    security = [{"bearer": ["admin"]}]
    filterable = "; ".join(
        f"{name}: {', '.join(view.filterable) or '(none)'}" for name, (_, view) in VIEWS.items()
    )
    create = {
        "type": "object",
        "required": ["url", "view"],
        "additionalProperties": False,
        "properties": {
            "url": {
                "type": "string",
                "format": "uri",
                "minLength": 1,
                "maxLength": MAX_URL,
                "description": "http(s), without credentials or fragment; a loopback, "
                "link-local or private address (or a name resolving to one) is refused unless "
                "LOGFOLD_WEBHOOK_ALLOW_PRIVATE is set",
            },
            "view": {"enum": sorted(VIEWS)},
            "filter": {
                "type": "object",
                "description": "column -> value over the view's filterable columns "
                f"({filterable}); a token's row claim narrows it",
            },
            "secret": {
                "type": "string",
                "pattern": "^whsec_[A-Za-z0-9+/]+={0,2}$",
                "description": "whsec_<base64 of 24-64 bytes>; generated when absent",
            },
            "from": {
                "enum": ["now", "beginning"],
                "description": "where deliveries start: changes from now on (the default), or "
                "all the changelog holds",
            },
        },
    }
    created = {
        "allOf": [WEBHOOK],
        "required": ["secret"],
        "properties": {"secret": {"type": "string", "description": "shown only here"}},
    }
    endpoint_id = {
        "name": "id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1},
    }
    status = {
        "type": "object",
        "required": ["status"],
        "additionalProperties": False,
        "properties": {"status": {"enum": ["active", "paused"]}},
    }
    replay = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "ids": {
                "type": "array",
                "items": {"type": "string"},
                "description": "the dead letters to replay (all failed ones when absent)",
            }
        },
    }
    return {
        "/webhooks": {
            "post": {
                "summary": "Register a webhook endpoint for one view's changes",
                "operationId": "create_webhook",
                "tags": ["webhooks"],
                "security": security,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": create}},
                },
                "responses": {
                    "201": {
                        **_json(created, "the endpoint, with its secret (shown only here)"),
                        "headers": {
                            "Location": {
                                "description": "/webhooks/<id>",
                                "schema": {"type": "string"},
                            }
                        },
                    },
                    **_pick(errors, "400", "401", "403", "413", "415", "422", "503"),
                },
            },
            "get": {
                "summary": "The webhook endpoints",
                "operationId": "list_webhooks",
                "tags": ["webhooks"],
                "security": security,
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["webhooks"],
                            "properties": {"webhooks": {"type": "array", "items": WEBHOOK}},
                        },
                        "every endpoint",
                    ),
                    **_pick(errors, "401", "403", "503"),
                },
            },
        },
        "/webhooks/{id}": {
            "get": {
                "summary": "One webhook endpoint",
                "operationId": "get_webhook",
                "tags": ["webhooks"],
                "security": security,
                "parameters": [endpoint_id],
                "responses": {
                    "200": _json(WEBHOOK, "the endpoint"),
                    **_pick(errors, "401", "403", "404", "503"),
                },
            },
            "patch": {
                "summary": "Pause an endpoint (its cursor stays) or resume it from its cursor",
                "operationId": "update_webhook",
                "tags": ["webhooks"],
                "security": security,
                "parameters": [endpoint_id],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": status}},
                },
                "responses": {
                    "200": _json(WEBHOOK, "the endpoint"),
                    **_pick(errors, "400", "401", "403", "404", "413", "415", "422", "503"),
                },
            },
            "delete": {
                "summary": "Delete an endpoint, and its dead letters",
                "operationId": "delete_webhook",
                "tags": ["webhooks"],
                "security": security,
                "parameters": [endpoint_id],
                "responses": {
                    "204": {"description": "deleted"},
                    **_pick(errors, "401", "403", "404", "503"),
                },
            },
        },
        "/webhooks/{id}/deliveries": {
            "get": {
                "summary": "An endpoint's dead letters, in changelog order",
                "operationId": "list_webhook_deliveries",
                "tags": ["webhooks"],
                "security": security,
                "parameters": [
                    endpoint_id,
                    {
                        "name": "status",
                        "in": "query",
                        "required": False,
                        "description": "only those with this status (all by default)",
                        "schema": {"enum": list(STATUSES)},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": DELIVERIES_LIMIT},
                    },
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "description": "`next` of the previous page",
                        "schema": {"type": "integer", "minimum": -1, "maximum": 2**63 - 1},
                    },
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["deliveries", "next"],
                            "properties": {
                                "deliveries": {"type": "array", "items": DEAD_LETTER},
                                "next": {"type": ["integer", "null"]},
                            },
                        },
                        "a page of dead letters",
                    ),
                    **_pick(errors, "401", "403", "404", "422", "503"),
                },
            }
        },
        "/webhooks/{id}/deliveries/replay": {
            "post": {
                "summary": "Deliver failed dead letters again, oldest first, under their ids",
                "operationId": "replay_webhook_deliveries",
                "tags": ["webhooks"],
                "security": security,
                "parameters": [endpoint_id],
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": replay}},
                },
                "responses": {
                    "202": _json(
                        {
                            "type": "object",
                            "required": ["replaying", "note"],
                            "properties": {
                                "replaying": {"type": "integer"},
                                "note": {"type": ["string", "null"]},
                            },
                        },
                        "how many were marked for delivery (a paused endpoint delivers them "
                        "once resumed)",
                    ),
                    **_pick(errors, "400", "401", "403", "404", "413", "415", "422", "503"),
                },
            }
        },
    }


def operations_paths(errors: dict[str, Any]) -> dict[str, Any]:
    health = {
        "type": "object",
        "required": ["status", "components"],
        "properties": {
            "status": {"enum": ["up", "down"]},
            "components": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["status"],
                    "properties": {"status": {"type": "string"}},
                },
            },
        },
    }
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/health": {
            "get": {
                "summary": "Readiness: each component, from background checks (admins see errors)",
                "operationId": "health",
                "tags": ["operations"],
                "security": [],
                "responses": {
                    "200": _json(health, "every component is up"),
                    "503": _json(health, "a component is down (see Retry-After)"),
                },
            }
        },
        "/health/live": {
            "get": {
                "summary": "Liveness: the process serves requests",
                "operationId": "live",
                "tags": ["operations"],
                "security": [],
                "responses": {"200": _json({"type": "object"}, "alive")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "operationId": "metrics",
                "tags": ["operations"],
                "security": [{"bearer": ["admin"]}],
                "responses": {
                    "200": {"description": "text exposition format", "content": text},
                    **_pick(errors, "401", "403"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "tags": ["operations"],
                "security": [],
                "responses": {"200": _json({"type": "object"}, "the OpenAPI document")},
            }
        },
        "/docs": {
            "get": {
                "summary": "This document, for people",
                "operationId": "docs",
                "tags": ["operations"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "an HTML page",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
