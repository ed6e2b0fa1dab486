"""The dispatcher's HTTP client: one POST, no redirects followed, bounded in time and in what
it reads back, and never to an address the policy refuses (`addresses.py`).

The host's name is resolved when connecting and every address is checked before a socket is
opened to it; the connection then goes to that very address (TLS still verifies the name), so
the address checked is the address reached and DNS rebinding cannot slip a private one in
between. Written on `http.client` (the standard library): it follows no redirects and honours
no proxy variables, and it lets the connect step be replaced."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from webhooks.addresses import Refused, allowed, check_url

USER_AGENT = "Logfold-Webhooks/1"


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no answer (refused, unreachable, timed out)
    error: str | None  # why it is not an acknowledgement, for the dead letter and the logs
    seconds: float

    @property
    def acknowledged(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def connect(host: str, port: int, timeout: float, allow_private: bool) -> socket.socket:
    """A TCP connection to the first address of `host` that the policy allows and answers;
    Refused when every address it resolves to is refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve {host}: {e.strerror}") from e
    refused: list[str] = []
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        reason = allowed(str(sockaddr[0]).split("%")[0], allow_private)
        if reason is not None:
            refused.append(reason)
            continue
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            last = e
    if last is not None:
        raise last
    raise Refused(f"{host} resolves only to refused addresses: {'; '.join(refused)}")


class Sender:
    """POSTs deliveries. `allow_private` lifts the address policy (tests, private receivers)."""

    def __init__(
        self,
        allow_private: bool = False,
        connect_timeout: float = 5.0,
        timeout: float = 15.0,
        max_response_bytes: int = 64 * 1024,
    ) -> None:
        self.allow_private = allow_private
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.max_response_bytes = max_response_bytes
        self.tls = ssl.create_default_context()

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Outcome:
        started = time.monotonic()
        try:
            status = self._post(url, body, headers, started + self.timeout)
        except Refused as e:
            return Outcome(None, f"refused: {e}", time.monotonic() - started)
        except TimeoutError:
            return Outcome(None, "timed out", time.monotonic() - started)
        except (OSError, http.client.HTTPException) as e:
            error = f"{type(e).__name__}: {e}"[:500]
            return Outcome(None, error, time.monotonic() - started)
        seconds = time.monotonic() - started
        if 200 <= status < 300:
            return Outcome(status, None, seconds)
        if 300 <= status < 400:
            return Outcome(status, f"HTTP {status}: redirects are not followed", seconds)
        return Outcome(status, f"HTTP {status}", seconds)

    def _post(self, url: str, body: bytes, headers: dict[str, str], deadline: float) -> int:
        scheme, host, port = check_url(url, self.allow_private)
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self.tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        allow, connect_timeout = self.allow_private, self.connect_timeout

        def guarded(address: tuple[str, int], *_: object) -> socket.socket:
            sock = connect(address[0], address[1], connect_timeout, allow)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return sock

        conn._create_connection = guarded  # type: ignore[attr-defined]
        try:
            conn.request(
                "POST",
                path,
                body=body,
                headers={
                    **headers,
                    "Content-Type": "application/json",
                    "User-Agent": USER_AGENT,
                    "Connection": "close",
                },
            )
            if conn.sock is not None:
                conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            response = conn.getresponse()
            left = self.max_response_bytes
            while left > 0 and time.monotonic() < deadline:
                chunk = response.read(min(left, 8192))  # read, so the peer is not reset
                if not chunk:
                    break
                left -= len(chunk)
            return response.status
        finally:
            conn.close()
