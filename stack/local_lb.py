"""A load balancer in front of several API nodes on this machine: HAProxy, from Debian's package.

How it routes (the configuration `LoadBalancer.config` writes):
- Each node is in the backend twice. As a regular server it is checked on `/health`
  (readiness): requests go to the nodes that are ready. As a backup it is checked on
  `/health/live`: when no node is ready (a dependency every node shares is down), requests still
  reach the live ones, which answer what they can and a JSON `503` for the rest, instead of the
  balancer's own page.
- `leastconn`: a websocket is a long connection; the node holding the fewest takes the next.
  Upgraded connections (websockets, server-sent events) stay open for `timeout tunnel`.
- A connection a node refuses (stopped, killed) is tried again on another node
  (`retry-on conn-failure`, `option redispatch`): a request that never reached a node is safe
  to send elsewhere. One that reached a node which then died gets a `502`; commands carry an
  `Idempotency-Key` to be retried safely.
- A node being stopped drains: it stops accepting at once (so new connections go elsewhere),
  finishes its requests, and closes its websockets with `1001` (clients reconnect through here
  and resume with `since`).
- When no node is up at all, the answer is the API's own JSON error shape with `503`.
- A client's connection is kept alive; the balancer's to a node is not (`option
  http-server-close`: a connection per request, on the local network). A node closes an idle
  kept-alive connection after gunicorn's `keepalive` (2 s), and a balancer reusing one just as
  the node closes it has no answer to give: for a request it may not send again (a `POST`), it
  closes the client's connection without one, as the node did, so that the client retries. Found
  by the cluster's fault tests: a command's client got a dropped connection, not a `201` or a
  `503`."""

from __future__ import annotations

import csv
import io
import resource
import shutil
import socket
import subprocess
from pathlib import Path

from stack.procs import free_port, port_open, stop_process, wait_until

CHECK_INTERVAL_MS = 1000  # a node that stopped answering is out after FALL checks
FALL, RISE = 2, 2
UNAVAILABLE = (
    '{"error": {"code": "unavailable", "message": "no API node is up behind the load '
    'balancer; retry after a few seconds", "details": []}}'
)
# A node that stopped (or went silent) in the middle of a request: the request may have been
# carried out (a command committed), so the answer says how to find out, not "nothing written".
NODE_LOST = (
    '{"error": {"code": "node_lost", "message": "the API node serving this request stopped '
    "before it answered; a command's outcome is unknown: send it again with the same "
    'Idempotency-Key", "details": []}}'
)
NODE_SILENT = (
    '{"error": {"code": "timeout", "message": "the API node serving this request did not '
    "answer in time; a command's outcome is unknown: send it again with the same "
    'Idempotency-Key", "details": []}}'
)
# HAProxy's own answers, in the API's error shape (it would send HTML): status, reason, body.
ERROR_PAGES = {
    502: ("Bad Gateway", NODE_LOST),
    503: ("Service Unavailable", UNAVAILABLE),
    504: ("Gateway Timeout", NODE_SILENT),
}


def haproxy() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError(
            "HAProxy is needed for the cluster topology: `apt-get install -y haproxy` "
            "(`make bootstrap` does this for you)"
        )
    return found


def maxconn() -> int:
    """Connections HAProxy holds at once: each takes two descriptors (client and node side),
    within the hard limit on open files (raising the soft one is HAProxy's own business)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 20000 if hard == resource.RLIM_INFINITY else max(256, min(20000, (hard - 200) // 2))


def haproxy_config(
    bind: str,
    backends: list[str],
    admin_socket: str,
    error_pages: str,
    stats_bind: str,
    max_connections: int,
    dns: str | None = None,
) -> str:
    """HAProxy's configuration: listening on `bind`, balancing over the API nodes at `backends`
    (`host:port` each) as the module's docstring says; its own answers from the files
    `<code>.http` in the folder `error_pages` (`error_page`); `dns`: a name server that
    resolves the nodes' names again as they come and go (containers). The same text for the
    local processes and for the containers of docker-compose.yml (stack/compose/haproxy.cfg)."""
    resolvers = f"\nresolvers dns\n    nameserver dns {dns}\n    hold valid 10s\n" if dns else ""
    addr = "init-addr libc,none" + (" resolvers dns" if dns else "")
    names = [f"api{i}" for i in range(1, len(backends) + 1)]
    ready = [f"    server {n} {a} check" for n, a in zip(names, backends, strict=True)]
    live = [
        f"    server {n}-live {a} backup track live/{n}"
        for n, a in zip(names, backends, strict=True)
    ]
    return f"""\
global
    maxconn {max_connections}
    stats socket {admin_socket} mode 600 level admin
{resolvers}
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout tunnel 1h
    timeout client-fin 5s
    timeout http-request 10s
    retries 3
    retry-on conn-failure
    option redispatch 1
    option http-server-close
{chr(10).join(f"    errorfile {code} {error_pages}/{code}.http" for code in ERROR_PAGES)}

frontend api
    bind {bind}
    default_backend api

frontend stats
    bind {stats_bind}
    http-request use-service prometheus-exporter if {{ path /metrics }}
    stats enable
    stats uri /

backend api
    balance leastconn
    option allbackups
    option httpchk GET /health
    http-check expect status 200
    # (a node's name that does not resolve yet, a container not started: down until it does)
    default-server inter {CHECK_INTERVAL_MS} fall {FALL} rise {RISE} {addr}
{chr(10).join(ready)}
{chr(10).join(live)}

# The same nodes checked for liveness only: the backups above follow these.
backend live
    option httpchk GET /health/live
    http-check expect status 200
    default-server inter {CHECK_INTERVAL_MS} fall {FALL} rise {RISE} {addr}
{chr(10).join(f"    server {n} {a} check" for n, a in zip(names, backends, strict=True))}
"""


def error_page(code: int) -> bytes:
    """The balancer's answer `code` of `ERROR_PAGES`, a whole HTTP response in the API's error
    shape: `503` when no node is up (retry after a few seconds), `502` and `504` when the
    node serving a request stopped or went silent before it answered."""
    reason, text = ERROR_PAGES[code]
    body = text.encode()
    retry = b"Retry-After: 2\r\n" if code == 503 else b""
    return (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n".encode()
        + retry
        + b"Cache-Control: no-cache\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


# docker-compose.yml's balancer: its files, rendered by the function above (a test checks they
# are; `python -m stack.local_lb` writes them again).
COMPOSE_DIR = Path(__file__).parent / "compose"
COMPOSE_NODES = ["api-1:8000", "api-2:8000"]


def compose_files() -> dict[Path, bytes]:
    config = haproxy_config(
        bind="*:8000",
        backends=COMPOSE_NODES,
        admin_socket="/tmp/haproxy-admin.sock",
        error_pages="/usr/local/etc/haproxy",
        stats_bind="*:8404",
        max_connections=20000,
        dns="127.0.0.11:53",  # Docker's own, on every container's network
    )
    pages = {COMPOSE_DIR / f"{code}.http": error_page(code) for code in ERROR_PAGES}
    return {COMPOSE_DIR / "haproxy.cfg": config.encode(), **pages}


class LoadBalancer:
    """HAProxy on `port`, balancing over the API nodes at `backends` (ports on 127.0.0.1)."""

    def __init__(self, data_dir: Path, port: int, backends: list[int]) -> None:
        # (absolute: HAProxy reads a relative socket path as an address)
        self.data_dir, self.port, self.backends = data_dir.resolve(), port, backends
        self.stats_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_socket(self) -> Path:
        return self.data_dir / "admin.sock"

    def config(self) -> str:
        return haproxy_config(
            bind=f"127.0.0.1:{self.port}",
            backends=[f"127.0.0.1:{port}" for port in self.backends],
            admin_socket=str(self.admin_socket),
            error_pages=str(self.data_dir),
            stats_bind=f"127.0.0.1:{self.stats_port}",
            max_connections=maxconn(),
        )

    def write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for code in ERROR_PAGES:
            (self.data_dir / f"{code}.http").write_bytes(error_page(code))
        path = self.data_dir / "haproxy.cfg"
        path.write_text(self.config())
        return path

    def start(self, timeout: float = 30.0) -> None:
        path = self.write_config()
        check = subprocess.run(
            [haproxy(), "-c", "-f", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        if check.returncode != 0:
            alerts = [line for line in check.stdout.decode().splitlines() if "ALERT" in line]
            raise RuntimeError(f"HAProxy refused {path}: {' '.join(alerts)}")
        log = (self.data_dir / "haproxy.out").open("ab")
        self.proc = subprocess.Popen(
            [haproxy(), "-db", "-f", str(path)],  # -db: in the foreground, a child of ours
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = self.proc

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"HAProxy exited with {proc.returncode}: see {self.data_dir / 'haproxy.out'}"
                )
            return port_open(self.port)

        wait_until(listening, timeout, f"the load balancer at {self.url}", fail_fast=True)

    def servers(self) -> dict[str, dict[str, str]]:
        """The backend's servers as HAProxy sees them: status (`UP`, `DOWN`, `MAINT`…), `scur`
        (connections open now), and the rest of its `show stat` columns."""
        rows = csv.DictReader(io.StringIO(self.command("show stat").lstrip("# ")))
        return {
            r["svname"]: r
            for r in rows
            if r["pxname"] == "api" and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def command(self, line: str) -> str:
        """One command on HAProxy's runtime API (its admin socket)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.admin_socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
            self.proc = None


if __name__ == "__main__":
    for path, content in compose_files().items():
        path.write_bytes(content)
        print(f"wrote {path}")
