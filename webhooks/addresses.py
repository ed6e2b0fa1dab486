"""Which addresses outbound calls may reach: public ones only, unless private ones are allowed
(`LOGFOLD_WEBHOOK_ALLOW_PRIVATE`). A webhook URL is chosen by whoever registers it, so without
this it could make the dispatcher call the metadata service of its cloud (169.254.169.254),
Postgres or Kafka on localhost, or anything else inside the network (server-side request
forgery). The check is made on each address a connection is actually opened to
(`outbound.py`), so a name that resolved to a public address at registration and to a private
one later (DNS rebinding) is refused too."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refused(ValueError):
    """A URL or address outbound calls must not reach."""


def refusal(address: str | IPAddress) -> str | None:
    """Why outbound calls must not reach `address`, or None when it is a public one."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        # ::ffff:10.0.0.1 reaches 10.0.0.1; so do the IPv4-compatible ::10.0.0.1 and the
        # 6to4 2002:0a00:0001:: on hosts that route them. Judge the IPv4 address inside.
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip.packed[:12] == bytes(12) and int(ip) > 1:
            inner = ipaddress.IPv4Address(ip.packed[12:])
        if inner is not None:
            reason = refusal(inner)
            return None if reason is None else f"{reason} (as {ip})"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is a link-local address"
    if ip.is_private:
        return f"{ip} is a private address"
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved or not ip.is_global:
        return f"{ip} is not a public address"
    return None


def allowed(address: str | IPAddress, allow_private: bool) -> str | None:
    """None when calls may reach `address` under the policy, else why not."""
    return None if allow_private else refusal(address)


def check_url(url: str, allow_private: bool) -> tuple[str, str, int]:
    """(scheme, host, port) of a webhook URL; Refused unless it is http(s) with a host and no
    credentials, and (when the host is an address) one the policy allows. Names are resolved
    and checked when connecting, every time."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise Refused(f"not a URL: {e}") from e
    if parts.scheme not in ("http", "https"):
        raise Refused("the URL must be http:// or https://")
    if not parts.hostname:
        raise Refused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise Refused("the URL must not carry credentials (the signature authenticates)")
    if parts.fragment:
        raise Refused("the URL must not have a fragment")
    host = parts.hostname
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        reason = allowed(literal, allow_private)
        if reason is not None:
            raise Refused(reason)
    elif not allow_private and (
        host.rstrip(".").lower() == "localhost" or host.lower().endswith(".localhost")
    ):
        raise Refused(f"{host} is a loopback name")
    return parts.scheme, host, port or (443 if parts.scheme == "https" else 80)
