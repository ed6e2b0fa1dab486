"""Many websocket subscribers in one process, cheap enough not to be the bottleneck.

Each subscriber connects to its own URL (the parent gives one per subscriber: a token each, so a
per-subject websocket limit of the server counts each alone). websocket-client does each
handshake and sends the `subscribe`; after that the raw sockets go
into one `selectors` loop that splits server frames itself and, for each `change`, only finds its
`position` (the last field of the message) and notes when it arrived. No JSON is decoded on the
hot path: all subscribers receive the same changes, so receipt times are kept per position and
joined with the changes' commit times by the parent.

The parent drives a fleet through a pipe (`Fleet`): connect, reset, count, collect, quit.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import resource
import selectors
import socket
import time
from array import array
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import websocket

CHANGE = b'{"type":"change"'
POSITION = b'"position":"'
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING = 0x0, 0x1, 0x2, 0x8, 0x9


@dataclass
class Received:
    """What a fleet's subscribers got since the last reset."""

    times: dict[bytes, array[float]] = field(default_factory=dict)  # position -> receipt times
    kinds: dict[str, int] = field(default_factory=dict)  # message type -> count (not changes)
    changes: int = 0
    bytes: int = 0


class Subscriber:
    """One websocket: splits the server's (unmasked) frames out of what the socket returns."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.partial = b""
        self.snapshot = False
        self.closed: int | None = None

    def read(self, got: Received) -> None:
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except OSError:
            self.closed = 1006
            return
        now = time.time()
        if not data:
            self.closed = self.closed or 1006
            return
        got.bytes += len(data)
        buf = self.buf + data if self.buf else data
        i, end = 0, len(buf)
        while end - i >= 2:
            b0, b1 = buf[i], buf[i + 1]
            n, head = b1 & 0x7F, 2
            if n == 126:
                if end - i < 4:
                    break
                n, head = int.from_bytes(buf[i + 2 : i + 4], "big"), 4
            elif n == 127:
                if end - i < 10:
                    break
                n, head = int.from_bytes(buf[i + 2 : i + 10], "big"), 10
            if b1 & 0x80:
                head += 4  # a server must not mask; tolerated (the payload is then garbled)
            if end - i < head + n:
                break
            payload = buf[i + head : i + head + n]
            i += head + n
            opcode = b0 & 0x0F
            if not b0 & 0x80:  # a fragment: keep it until the final one
                self.partial += payload
                continue
            if opcode == OP_CONT:
                payload, self.partial = self.partial + payload, b""
            if opcode in (OP_TEXT, OP_BINARY, OP_CONT):
                self._message(payload, now, got)
            elif opcode == OP_CLOSE:
                self.closed = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
            elif opcode == OP_PING:
                pong = websocket.ABNF.create_frame(payload, websocket.ABNF.OPCODE_PONG)
                self.sock.setblocking(True)
                self.sock.sendall(pong.format())
                self.sock.setblocking(False)
        self.buf = buf[i:]

    def _message(self, payload: bytes, now: float, got: Received) -> None:
        if payload.startswith(CHANGE):
            start = payload.rfind(POSITION) + len(POSITION)
            position = payload[start : payload.index(b'"', start)]
            times = got.times.get(position)
            if times is None:
                times = got.times[position] = array("d")
            times.append(now)
            got.changes += 1
            return
        kind = str(json.loads(payload).get("type"))
        got.kinds[kind] = got.kinds.get(kind, 0) + 1
        if kind == "snapshot":
            self.snapshot = True


def _run(urls: list[str], subscribe: dict[str, Any], control: Connection) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, len(urls) + 256)), hard))
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, None)
    subscribers: list[Subscriber] = []
    got = Received()
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.data is not None:
                sub: Subscriber = key.data
                sub.read(got)
                if sub.closed is not None:
                    selector.unregister(sub.sock)
                continue
            op = control.recv()
            if op == "connect":
                for url in urls:
                    ws = websocket.create_connection(url, timeout=60)
                    ws.send(json.dumps(subscribe))
                    assert ws.sock is not None
                    ws.sock.setblocking(False)
                    sub = Subscriber(ws.sock)
                    subscribers.append(sub)
                    selector.register(sub.sock, selectors.EVENT_READ, sub)
                control.send(len(subscribers))
            elif op == "status":
                control.send(
                    {
                        "snapshots": sum(s.snapshot for s in subscribers),
                        "closed": sum(s.closed is not None for s in subscribers),
                        "changes": got.changes,
                    }
                )
            elif op in ("pause", "resume"):
                # The clients stop reading (their frames wait in the kernel's socket buffers),
                # as if they ran on other machines: their own CPU leaves this one's cores.
                for s in subscribers:
                    if s.closed is None:
                        if op == "pause":
                            selector.unregister(s.sock)
                        else:
                            selector.register(s.sock, selectors.EVENT_READ, s)
                control.send(True)
            elif op == "reset":
                got = Received()
                control.send(True)
            elif op == "collect":
                closes: dict[str, int] = {}
                for s in subscribers:
                    if s.closed is not None:
                        closes[str(s.closed)] = closes.get(str(s.closed), 0) + 1
                usage = resource.getrusage(resource.RUSAGE_SELF)
                control.send(
                    {
                        "times": got.times,
                        "kinds": got.kinds,
                        "changes": got.changes,
                        "bytes": got.bytes,
                        "closes": closes,
                        "cpu_s": usage.ru_utime + usage.ru_stime,
                    }
                )
            elif op == "quit":
                for s in subscribers:
                    s.sock.close()
                control.send(True)
                return


class Fleet:
    """A subscriber per URL of `urls` in a child process, all sending the same `subscribe`
    message."""

    def __init__(self, urls: list[str], subscribe: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.control, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_run, args=(urls, subscribe, child), name="ws-fleet", daemon=True
        )
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def ask(self, op: str, timeout: float = 600) -> Any:
        self.control.send(op)
        if not self.control.poll(timeout):
            raise TimeoutError(f"the websocket fleet did not answer {op!r} in {timeout:.0f}s")
        return self.control.recv()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.ask("quit", timeout=30)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.control.close()
