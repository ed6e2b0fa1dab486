"""The OpenAPI document, generated from the same pydantic models that validate commands."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from commands.registry import COMMANDS
from commands.schemas import CommandRequest

ERRORS = {
    "400": "malformed_json",
    "401": "unauthorized",
    "403": "forbidden",
    "404": "not_found",
    "409": "version_conflict or rule_violated",
    "413": "payload_too_large",
    "415": "unsupported_media_type",
    "422": "validation_failed or idempotency_key_reused",
    "503": "unavailable (see Retry-After)",
    "504": "timeout",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_spec() -> dict[str, Any]:
    models: list[type[BaseModel]] = [CommandRequest, *(s.schema for s in COMMANDS.values())]
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
                "security": [{"bearer": ["commands:write"]}],
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
    paths["/health"] = {
        "get": {
            "summary": "Health of each component",
            "security": [],
            "responses": {
                "200": {"description": "all up"},
                "503": {"description": "a component is down"},
            },
        }
    }
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics",
            "security": [{"bearer": ["admin"]}],
            "responses": {"200": {"description": "text exposition format"}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Logfold",
            "version": "0.1.0",
            "description": "Commands in, events to Kafka, views out. See API.md.",
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
