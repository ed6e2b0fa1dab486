"""`/webhooks…` (scope `admin`): register, list, pause, resume and delete webhook endpoints, and
list and replay their dead letters. Deliveries are the dispatcher's (`logfold webhooks`,
`webhooks/`); this only writes what it reads, and notifies it."""

from __future__ import annotations

import ipaddress
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Timeout
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from kafka.errors import KafkaError

from app.auth import narrowed, require, row_scope
from app.errors import ApiError, database_unavailable, json_object, unavailable
from app.read_model import BadValue, coerce
from config.settings import Settings
from projections.base.wire import wire_value
from projections.registry import VIEWS
from webhooks.addresses import Refused, allowed, check_url
from webhooks.signing import BadSecret, key_of, new_secret
from webhooks.store import DeadLetter, Endpoint, WebhookStore
from webhooks.worker import changelog_end

bp = Blueprint("webhooks", __name__)

STATUSES = ("failed", "replaying", "delivered")
MAX_LIMIT = 500
FIELDS = {"url", "view", "filter", "secret", "from"}
MAX_URL = 2048
# A URL is ASCII (RFC 3986: an international name as punycode, the rest percent-encoded)
# without spaces or control characters: what the dispatcher can send a request line for.
URL_CHARACTERS = re.compile(r"[\x21-\x7e]+")
INTEGER = re.compile(r"-?[0-9]{1,19}")  # a bigint; Python refuses to parse 4,300 digits
# How long a registration waits for the URL's name to resolve. A name that has not resolved by
# then is taken as one that does not resolve now (see `_url`); the lookup is left to finish in
# the background, in a few threads of its own, so slow DNS never holds a request for long.
RESOLVE_TIMEOUT_S = 1.0
_resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="webhook-resolve")


def _settings() -> Settings:
    settings: Settings = current_app.extensions["logfold.settings"]
    return settings


def _store() -> WebhookStore:
    return WebhookStore(_settings().api_database())


def _invalid(field: str, problem: str) -> ApiError:
    return ApiError(422, "validation_failed", problem, [{"field": field, "problem": problem}])


def _storable(value: str) -> bool:
    """Whether Postgres text (UTF-8, no NUL) can hold `value`."""
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate, from a JSON `\ud800` escape
        return False
    return "\x00" not in value


def _shown(endpoint: Endpoint, secret: bool = False) -> dict[str, Any]:
    """An endpoint as the API shows it: its secret only when it is created."""
    body = {
        "id": endpoint.id,
        "url": endpoint.url,
        "view": endpoint.view,
        "filter": endpoint.filter,
        "status": endpoint.status,
        "paused_reason": endpoint.paused_reason,
        "cursor": endpoint.cursor,
        "failing_since": wire_value(endpoint.failing_since),
        "last_error": endpoint.last_error,
        "attempts": endpoint.attempts,
        "dead_letters": endpoint.dead_letters,
        "skipped_offsets": endpoint.skipped_offsets,
        "created_at": wire_value(endpoint.created_at),
        "updated_at": wire_value(endpoint.updated_at),
    }
    return {**body, "secret": endpoint.secret} if secret else body


def _letter(letter: DeadLetter) -> dict[str, Any]:
    return {
        "id": letter.message_id,
        "offset": letter.offset,
        "position": letter.position,
        "key": letter.key,
        "body": letter.body,
        "attempts": letter.attempts,
        "last_error": letter.last_error,
        "first_attempt_at": wire_value(letter.first_attempt_at),
        "failed_at": wire_value(letter.failed_at),
        "status": letter.status,
        "replayed_at": wire_value(letter.replayed_at),
    }


def _url(value: Any, allow_private: bool) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_URL:
        raise _invalid("url", f"a URL of at most {MAX_URL} characters")
    if not URL_CHARACTERS.fullmatch(value):
        raise _invalid(
            "url",
            "a URL is printable ASCII without spaces: give an international name as punycode "
            "(xn--...) and percent-encode the rest",
        )
    try:
        _, host, port = check_url(value, allow_private)
    except Refused as e:
        raise _invalid("url", str(e)) from e
    if not _literal(host):
        try:
            host.encode("idna")  # as the resolver will, here and in the dispatcher
        except UnicodeError as e:
            raise _invalid("url", f"{host!r} is not a valid host name") from e
    # A name that resolves to a refused address now is refused now; the dispatcher checks the
    # address again at every connection (the name may resolve differently later).
    if not allow_private:
        for *_, sockaddr in _resolve(host, port):
            reason = allowed(str(sockaddr[0]).split("%")[0], allow_private)
            if reason is not None:
                raise _invalid("url", f"{host} resolves to a refused address: {reason}")
    return value


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, port: int) -> list[Any]:
    """`host`'s addresses, or none when it does not resolve now (or not within
    RESOLVE_TIMEOUT_S): its deliveries then fail, and are retried, until it does, and the
    dispatcher checks every address it connects to whatever this found."""
    lookup = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        return lookup.result(timeout=RESOLVE_TIMEOUT_S)
    except Timeout:
        lookup.cancel()  # if it is still waiting for a thread
        return []
    except (OSError, UnicodeError):
        return []


def _filter(value: Any, view: str) -> dict[str, Any]:
    _, output = VIEWS[view]
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _invalid("filter", "an object of column -> value")
    unknown = [k for k in value if k not in output.filterable]
    if unknown:
        raise ApiError(
            422,
            "validation_failed",
            "unknown filter",
            [
                {
                    "field": f"filter.{k}",
                    "problem": f"not filterable; use {list(output.filterable)}",
                }
                for k in unknown
            ],
        )
    # The token's row claim narrows the filter, never widens it (as for reads).
    forced = row_scope(g.rows, output.name, output.columns)
    chosen = narrowed(value, forced)
    for c, v in chosen.items():
        if isinstance(v, str) and not _storable(v):
            raise _invalid(f"filter.{c}", "a value without NUL characters or lone surrogates")
    try:
        return {
            c: None if v is None else wire_value(coerce(output.table.c[c], v))
            for c, v in chosen.items()
        }
    except BadValue as e:
        raise _invalid("filter", str(e)) from e


@bp.post("/webhooks")
@require("admin")
@database_unavailable
def create() -> tuple[Response, int, dict[str, str]]:
    settings = _settings()
    body = json_object()
    extra = sorted(set(body) - FIELDS)
    if extra:
        raise _invalid(extra[0], f"unknown field; the fields are {sorted(FIELDS)}")
    url = _url(body.get("url"), settings.webhook_allow_private)
    view = body.get("view")
    if not isinstance(view, str) or view not in VIEWS:
        raise _invalid("view", f"one of {sorted(VIEWS)}")
    filter = _filter(body.get("filter"), view)
    secret = body.get("secret")
    if secret is None:
        secret = new_secret()
    elif not isinstance(secret, str):
        raise _invalid("secret", "whsec_<base64>")
    else:
        try:
            key_of(secret)
        except BadSecret as e:
            raise _invalid("secret", str(e)) from e
    start = body.get("from", "now")
    if start not in ("now", "beginning"):
        raise _invalid("from", "`now` (changes from now on, the default) or `beginning`")
    cursor = 0
    if start == "now":
        try:
            cursor = changelog_end(settings, view, settings.kafka_timeout_s)
        except KafkaError as e:
            raise unavailable("Kafka is unavailable; try again", e) from e
    endpoint = _store().create(url, view, filter, secret, cursor)
    location = {"Location": f"/webhooks/{endpoint.id}"}
    return jsonify(_shown(endpoint, secret=True)), 201, location


@bp.get("/webhooks")
@require("admin")
@database_unavailable
def list_endpoints() -> Response:
    return jsonify({"webhooks": [_shown(e) for e in _store().all()]})


def _endpoint(store: WebhookStore, endpoint_id: str) -> Endpoint:
    found = store.get(endpoint_id) if _storable(endpoint_id) else None
    if found is None:
        raise _missing(endpoint_id)
    return found


def _missing(endpoint_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no webhook {endpoint_id!r}")


@bp.get("/webhooks/<endpoint_id>")
@require("admin")
@database_unavailable
def get(endpoint_id: str) -> Response:
    return jsonify(_shown(_endpoint(_store(), endpoint_id)))


@bp.patch("/webhooks/<endpoint_id>")
@require("admin")
@database_unavailable
def update(endpoint_id: str) -> Response:
    """`{"status": "paused"}` pauses the endpoint (its cursor stays); `{"status": "active"}`
    resumes it from its cursor."""
    body = json_object()
    status = body.get("status")
    if set(body) - {"status"} or status not in ("active", "paused"):
        raise _invalid("status", "`active` or `paused` (the only field that changes)")
    if not _storable(endpoint_id):  # no webhook has such an id
        raise _missing(endpoint_id)
    store = _store()
    done = store.resume(endpoint_id) if status == "active" else store.pause(endpoint_id, "paused")
    if not done:
        raise _missing(endpoint_id)
    return jsonify(_shown(_endpoint(store, endpoint_id)))


@bp.delete("/webhooks/<endpoint_id>")
@require("admin")
@database_unavailable
def delete(endpoint_id: str) -> tuple[str, int]:
    if not _storable(endpoint_id) or not _store().delete(endpoint_id):
        raise _missing(endpoint_id)
    return "", 204


@bp.get("/webhooks/<endpoint_id>/deliveries")
@require("admin")
@database_unavailable
def deliveries(endpoint_id: str) -> Response:
    """The endpoint's dead letters (`status`: failed, replaying or delivered; all by default),
    in changelog order, a page at a time (`after`: the last offset of the previous page)."""
    status = request.args.get("status")
    if status is not None and status not in STATUSES:
        raise _invalid("status", f"one of {list(STATUSES)}")
    limit, after = _int("limit", 100, 1, MAX_LIMIT), _int("after", None, -1, 2**63 - 1)
    store = _store()
    _endpoint(store, endpoint_id)
    letters = store.dead_letters(endpoint_id, status, limit + 1, after)
    more = len(letters) > limit
    letters = letters[:limit]
    page = [_letter(d) for d in letters]
    return jsonify({"deliveries": page, "next": letters[-1].offset if more else None})


def _int(name: str, default: int | None, low: int, high: int) -> Any:
    raw = request.args.get(name)
    if raw is None:
        return default
    if not INTEGER.fullmatch(raw) or not low <= int(raw) <= high:
        raise _invalid(name, f"an integer from {low} to {high}")
    return int(raw)


@bp.post("/webhooks/<endpoint_id>/deliveries/replay")
@require("admin")
@database_unavailable
def replay(endpoint_id: str) -> tuple[Response, int]:
    """Deliver failed dead letters again (all, or `{"ids": [...]}`), same ids, oldest first.
    A replayed change may be older than changes of its key delivered since: its `position`
    tells a receiver which is newer."""
    ids: list[str] | None = None
    if request.content_length:
        body = json_object()
        ids = body.get("ids")
        if set(body) - {"ids"} or not (
            ids is None
            or (isinstance(ids, list) and all(isinstance(i, str) and _storable(i) for i in ids))
        ):
            raise _invalid("ids", "a list of delivery ids (all failed ones when absent)")
    store = _store()
    endpoint = _endpoint(store, endpoint_id)
    marked = store.replay(endpoint_id, ids)
    note = None if endpoint.status == "active" else "the endpoint is paused: resume it to replay"
    return jsonify({"replaying": marked, "note": note}), 202
