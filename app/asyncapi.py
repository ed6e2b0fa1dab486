"""`/asyncapi.json`: the push side of the API as an AsyncAPI 3.1 document, the event-API
counterpart of `/openapi.json`. It describes what Logfold sends and receives on the websocket
(`/ws`), the messages of a server-sent events stream (`/views/<view>/events`), and the
webhook deliveries. Built from the same declarations as the rest (the views, their columns), so
it cannot drift from them; tests parse it with the AsyncAPI project's own parser and check that
every message type the server sends is in it."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from app.ws_messages import MAX_WAIT_S
from projections.registry import VIEWS

bp = Blueprint("asyncapi", __name__)

Schema = dict[str, Any]

POSITION = {
    "type": "string",
    "description": "a change's position in the WAL (`<lsn>.<n>`) or a snapshot's "
    "(`xmin:xmax:xip,…`); give it back as `since` (or `Last-Event-ID`) to resume after it",
}
SUB_ID = {"type": ["string", "null"], "description": "the subscription it concerns"}


def _object(properties: Schema, required: list[str] | None = None, **extra: Any) -> Schema:
    return {
        "type": "object",
        "required": required if required is not None else list(properties),
        "properties": properties,
        **extra,
    }


def _const(value: str) -> Schema:
    return {"type": "string", "const": value}


ROW = {"type": "object", "description": "a row of the view, in wire form (its columns)"}

# What the server sends: the same bodies over a websocket (a text message each), as the data
# of a server-sent event (its event name the `type`), and within a long-poll's `changes`.
SERVER: dict[str, Schema] = {
    "subscribed": _object({"type": _const("subscribed"), "id": SUB_ID}),
    "snapshot": _object(
        {
            "type": _const("snapshot"),
            "id": SUB_ID,
            "rows": {"type": "array", "items": ROW},
            "position": POSITION,
        }
    ),
    "change": _object(
        {
            "type": _const("change"),
            "id": SUB_ID,
            "op": {"enum": ["upsert", "delete"], "description": "delete: the row left the view"},
            "key": {"type": "object", "description": "the row's key columns"},
            "row": {"type": ["object", "null"], "description": "the row (null on delete)"},
            "position": POSITION,
        }
    ),
    "resync": _object(
        {"type": _const("resync"), "id": SUB_ID},
        description="the position can no longer be served (or the view was rebuilt): drop "
        "the rows held; a new snapshot follows",
    ),
    "lagging": _object(
        {
            "type": _const("lagging"),
            "id": SUB_ID,
            "behind": {"type": "integer", "description": "messages queued for this client"},
        },
        description="the client reads too slowly; at twice as far behind it is disconnected "
        "(websocket close code 4008; a stream ends with error `too_slow`)",
    ),
    "heartbeat": _object(
        {"type": _const("heartbeat")},
        description="websocket only, when idle (a stream sends `: heartbeat` comments)",
    ),
    "unsubscribed": _object({"type": _const("unsubscribed"), "id": SUB_ID}),
    "error": _object(
        {
            "type": _const("error"),
            "id": SUB_ID,
            "code": {
                "type": "string",
                "examples": [
                    "validation_failed",
                    "not_found",
                    "forbidden",
                    "unauthorized",
                    "too_many_requests",
                    "too_many_subscriptions",
                    "too_many_rows",
                    "unavailable",
                    "timeout",
                    "too_slow",
                    "going_away",
                    "internal",
                ],
            },
            "message": {"type": "string"},
        },
        ["type", "id", "code", "message"],
        additionalProperties=True,
    ),
}

# What a websocket client sends.
CLIENT: dict[str, Schema] = {
    "auth": _object({"op": _const("auth"), "token": {"type": "string"}}),
    "subscribe": _object(
        {
            "op": _const("subscribe"),
            "id": {"type": "string", "minLength": 1, "maxLength": 64},
            "view": {"enum": sorted(VIEWS)},
            "filter": {"type": "object", "maxProperties": 16},
            "since": POSITION,
            "consistent_with": {"type": "string", "description": "a command's `position`"},
            "wait": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
        },
        ["op", "id", "view"],
        additionalProperties=False,
    ),
    "unsubscribe": _object({"op": _const("unsubscribe"), "id": {"type": "string"}}),
}

STREAMED = ("snapshot", "change", "resync", "lagging", "error")  # a stream's event names

WEBHOOK = _object(
    {
        "type": _const("change"),
        "view": {"enum": sorted(VIEWS)},
        "op": {"enum": ["upsert", "delete"]},
        "key": {"type": "object"},
        "row": {"type": ["object", "null"]},
        "position": POSITION,
    }
)


def _message(name: str, payload: Schema, summary: str) -> Schema:
    return {"name": name, "title": name, "summary": summary, "payload": payload}


def build(host: str, version: str) -> Schema:
    messages = {
        **{f"server.{n}": _message(n, s, f"server → client: {n}") for n, s in SERVER.items()},
        **{f"client.{n}": _message(n, s, f"client → server: {n}") for n, s in CLIENT.items()},
        "webhook.change": {
            **_message("change", WEBHOOK, "a view change delivered to a webhook endpoint"),
            "headers": _object(
                {
                    "webhook-id": {"type": "string", "description": "stable across retries"},
                    "webhook-timestamp": {"type": "string", "description": "Unix seconds"},
                    "webhook-signature": {
                        "type": "string",
                        "description": "`v1,<base64 HMAC-SHA256 of id.timestamp.body>` with "
                        "the endpoint's secret (Standard Webhooks)",
                    },
                }
            ),
        },
    }

    def refs(names: list[str]) -> dict[str, Schema]:
        return {n.replace(".", "_"): {"$ref": f"#/components/messages/{n}"} for n in names}

    def channel_refs(channel: str, names: list[str]) -> list[Schema]:
        return [{"$ref": f"#/channels/{channel}/messages/{n.replace('.', '_')}"} for n in names]

    server_names = [f"server.{n}" for n in SERVER]
    client_names = [f"client.{n}" for n in CLIENT]
    streamed = [f"server.{n}" for n in STREAMED]
    return {
        "asyncapi": "3.1.0",
        "info": {
            "title": "Logfold push API",
            "version": version,
            "description": "View changes pushed to clients: a snapshot, then every later "
            "change in order with no gap and no duplicate, resumable from the last position "
            "(docs/api.md). The REST side is /openapi.json.",
        },
        "defaultContentType": "application/json",
        "servers": {
            "websocket": {"host": host, "protocol": "ws", "description": "`/ws`"},
            "http": {"host": host, "protocol": "http", "description": "server-sent events"},
        },
        "channels": {
            "websocket": {
                "address": "/ws",
                "title": "Websocket subscriptions",
                "description": "Authenticate with `?token=` or a first `auth` message (scope "
                "`views:read`), then subscribe to views; several subscriptions share one "
                "connection, told apart by their `id`.",
                "servers": [{"$ref": "#/servers/websocket"}],
                "messages": refs(server_names + client_names),
            },
            "viewEvents": {
                "address": "/views/{view}/events",
                "title": "Server-sent events of one view",
                "description": "`text/event-stream`: each message is an event named by its "
                "`type` with the message as its data; snapshots and changes carry their "
                "position as the event's `id`. The filter is the query string; the token the "
                "`Authorization` header or `?token=`.",
                "parameters": {"view": {"enum": sorted(VIEWS)}},
                "servers": [{"$ref": "#/servers/http"}],
                "messages": refs(streamed),
            },
            "webhookDeliveries": {
                "address": "{endpoint}",
                "title": "Webhook deliveries",
                "description": "A `POST` to each endpoint registered with `POST /webhooks`, "
                "in order per key, at least once; any `2xx` acknowledges it.",
                "parameters": {"endpoint": {"description": "the endpoint's URL"}},
                "messages": refs(["webhook.change"]),
            },
        },
        "operations": {
            "sendToWebsocket": {
                "action": "send",
                "channel": {"$ref": "#/channels/websocket"},
                "messages": channel_refs("websocket", server_names),
            },
            "receiveFromWebsocket": {
                "action": "receive",
                "channel": {"$ref": "#/channels/websocket"},
                "messages": channel_refs("websocket", client_names),
            },
            "streamViewEvents": {
                "action": "send",
                "channel": {"$ref": "#/channels/viewEvents"},
                "messages": channel_refs("viewEvents", streamed),
            },
            "deliverWebhooks": {
                "action": "send",
                "channel": {"$ref": "#/channels/webhookDeliveries"},
                "messages": channel_refs("webhookDeliveries", ["webhook.change"]),
            },
        },
        "components": {"messages": messages},
    }


@bp.get("/asyncapi.json")
def document() -> Response:
    version = current_app.extensions["logfold.openapi"]["info"]["version"]
    return jsonify(build(request.host, version))
