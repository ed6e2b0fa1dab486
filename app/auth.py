"""Bearer tokens (JWT, HS256) with scopes: `commands:write`, `views:read`, `streams:write`,
`admin`. Each names this API as its audience (`aud`) and lives no longer than the API accepts
(`exp` - `iat`, LOGFOLD_JWT_MAX_TTL_S): a leaked token is good for a bounded time only."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jwt
from flask import current_app, g, has_app_context, request

from app.errors import ApiError
from config.settings import JWT_AUDIENCE, JWT_MAX_TTL_S

SCOPES = ("commands:write", "views:read", "streams:write", "admin")
ISSUER = "logfold"
MIN_SECRET_BYTES = 32  # HS256 keys shorter than the hash (RFC 7518 3.2) are guessable
# Values people copy from examples; a secret containing one is somebody else's secret.
PLACEHOLDERS = ("changeme", "replaceme", "yoursecret", "secretkey", "example", "placeholder")
HOW = "e.g. `openssl rand -base64 48`"


class WeakSecret(ValueError):
    pass


def check_secret(secret: str | None) -> str:
    """`secret` if it can sign tokens; raises WeakSecret saying what to do otherwise."""
    if not secret:
        raise WeakSecret(f"LOGFOLD_JWT_SECRET is not set; set it to a random secret ({HOW})")
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise WeakSecret(
            f"LOGFOLD_JWT_SECRET has {len(secret.encode())} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} ({HOW})"
        )
    letters = "".join(c for c in secret.lower() if c.isalnum())
    if any(word in letters for word in PLACEHOLDERS) or len(set(secret)) < 8:
        raise WeakSecret(
            f"LOGFOLD_JWT_SECRET is a placeholder, not a secret; use a random one ({HOW})"
        )
    return secret


F = TypeVar("F", bound=Callable[..., Any])


def issue_token(
    secret: str,
    subject: str = "developer",
    scopes: tuple[str, ...] = SCOPES,
    ttl_s: int = JWT_MAX_TTL_S,
    rows: dict[str, str] | None = None,
    audience: str = JWT_AUDIENCE,
) -> str:
    """A signed token. `rows` (column -> value) restricts every read and subscription of a
    view that has one of those columns to the rows holding those values (guarantee 18)."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": subject,
        "scope": " ".join(scopes),
        "iss": ISSUER,
        "aud": audience,
        "iat": now,
        "exp": now + ttl_s,
    }
    if rows:
        claims["rows"] = rows
    return jwt.encode(claims, secret, algorithm="HS256")


def verify(
    token: str, secret: str, audience: str | None = None, max_ttl_s: int | None = None
) -> dict[str, Any]:
    """The token's claims; raises ApiError(401) on anything not signed by us for `audience`,
    living longer than `max_ttl_s`, or expired. Unset, those are the app's (JWT_AUDIENCE,
    JWT_MAX_TTL_S of its config, from Settings)."""
    audience = audience or _config("JWT_AUDIENCE", JWT_AUDIENCE)
    max_ttl_s = max_ttl_s or _config("JWT_MAX_TTL_S", JWT_MAX_TTL_S)
    try:
        claims = _signed_claims(token, secret, audience)
    except jwt.InvalidTokenError as e:
        raise ApiError(401, "unauthorized", f"invalid token: {e}") from e
    lifetime = claims["exp"] - claims["iat"]
    if lifetime > max_ttl_s:
        raise ApiError(
            401,
            "unauthorized",
            f"the token's lifetime is too long: {lifetime:.0f} s from `iat` to `exp`, and this "
            f"API accepts at most {max_ttl_s} s (LOGFOLD_JWT_MAX_TTL_S); get a shorter-lived one",
        )
    if not time.time() < claims["exp"]:
        raise ApiError(401, "unauthorized", "the token has expired; get a new one")
    return claims


def _config(key: str, default: Any) -> Any:
    return current_app.config.get(key, default) if has_app_context() else default


@functools.lru_cache(maxsize=4096)
def _signed_claims(token: str, secret: str, audience: str) -> dict[str, Any]:
    """The claims of a token signed with `secret` (expiry checked by the caller, per use).
    Remembered: a client sends the same token with every request, and checking its signature
    and claims each time was a sixth of a command's time in the API (docs/benchmarks-journal.md).
    Callers must not modify the returned dict."""
    claims: dict[str, Any] = jwt.decode(
        token,
        secret,
        algorithms=["HS256"],
        issuer=ISSUER,
        audience=audience,
        options={"require": ["sub", "exp", "iat", "aud", "scope"], "verify_exp": False},
    )
    for claim in ("exp", "iat"):
        if not isinstance(claims[claim], int | float) or isinstance(claims[claim], bool):
            raise jwt.InvalidTokenError(f"`{claim}` must be a number")
    rows = claims.get("rows")
    if rows is not None and not (
        isinstance(rows, dict)
        and rows
        and all(isinstance(k, str) and isinstance(v, str) for k, v in rows.items())
    ):
        raise jwt.InvalidTokenError("`rows` must map columns to values")
    return claims


def bearer_token() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def scopes(claims: dict[str, Any]) -> set[str]:
    return set(str(claims.get("scope", "")).split())


def has_scope(scope: str) -> bool:
    """Whether the request carries a valid token with `scope`, for endpoints open to all that
    show more to some (no token, or a bad one, is simply `False`)."""
    token = bearer_token()
    if token is None:
        return False
    try:
        return scope in scopes(verify(token, current_app.config["JWT_SECRET"]))
    except ApiError:
        return False


def require(scope: str | Callable[..., str], query_token: bool = False) -> Callable[[F], F]:
    """Route decorator: 401 without a valid token, 403 when it lacks `scope` (or the scope
    `scope` gives for the route's arguments). `query_token`: the token may come as `?token=`
    too (a browser's EventSource cannot send headers)."""

    def decorate(view: F) -> F:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = bearer_token() or (request.args.get("token") if query_token else None)
            if not token:
                also = " (or `?token=<token>`)" if query_token else ""
                raise ApiError(
                    401,
                    "unauthorized",
                    f"send `Authorization: Bearer <token>`{also}",
                    headers={"WWW-Authenticate": 'Bearer realm="logfold"'},
                )
            claims = verify(token, current_app.config["JWT_SECRET"])
            needed = scope(**kwargs) if callable(scope) else scope
            if needed not in scopes(claims):
                raise ApiError(403, "forbidden", f"this endpoint needs the {needed!r} scope")
            g.subject, g.rows = str(claims["sub"]), claims.get("rows") or {}
            g.claims = claims
            return view(*args, **kwargs)

        return cast(F, wrapper)

    return decorate


def row_scope(rows: dict[str, str], view: str, columns: tuple[str, ...]) -> dict[str, str]:
    """The filter a token's row claim forces on `view` (the claim's columns the view has): none
    without a claim; `403` when the token has a claim and the view none of its columns."""
    if not rows:
        return {}
    forced = {c: v for c, v in rows.items() if c in columns}
    if not forced:
        raise ApiError(
            403,
            "forbidden",
            f"this token may read only rows of {sorted(rows)}; {view} has no such column",
        )
    return forced


def narrowed(filters: dict[str, Any], forced: dict[str, str]) -> dict[str, Any]:
    """`filters` within the row claim: they may narrow it, never widen it (`403`)."""
    for column, value in forced.items():
        if column in filters and str(filters[column]) != value:
            raise ApiError(
                403, "forbidden", f"this token may read only rows with {column} = {value!r}"
            )
    return {**filters, **forced}
