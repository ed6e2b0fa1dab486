"""The ceiling of `live.py fanout`: one plain Python process pushing the same websocket frames
to the same subscribers, without Logfold, Kafka or Postgres.

It says how much of the fan-out's cost is Logfold's and how much is anyone's: a websocket per
subscriber, a frame per change per subscriber, read by the same client fleet on the same
machine. So it is deliberately the simplest honest pusher: one thread, one `selectors` loop,
non-blocking sockets. wsproto does the handshakes and reads what clients send (their
`subscribe`, closes, pongs); each `change` is serialised and framed once (as the hub's
`customers` changes: the same fields, rows and position format, hence the same size) and the
same bytes are written to every socket. What a socket does not take at once waits in that
socket's own buffer and is written when it becomes writable.

A change's "commit" time is when the loop decides to send it (before its first write): the
parent joins it with the fleet's receipt times by position, as it joins Logfold's commit times.

Rates: a positive rate decides changes on a fixed schedule; rate 0 decides the next change as
soon as every socket has taken the previous ones (nothing left in this process's buffers), for
the duration: messages/s at saturation, with the queues bounded by the sockets' own.

Run as a subprocess (`Ceiling` does it); it listens on a free port of 127.0.0.1 and is driven
by one JSON object a line on stdin, answering one a line on stdout (the first is its port):

    {"op": "status"}                   -> {"clients": n, "subscribed": n, "closed": n}
    {"op": "push", "rate": r, "duration": s, "rows": [row, ...], "lsn": n}
                                       -> {"sent": n, "decided": {position: epoch_s, ...},
                                           "message_bytes": n, "cpu_s": s}
    {"op": "quit"}                     -> {}
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    Request,
    TextMessage,
)

LISTENER, CONTROL = "listener", "control"
FLUSH_TIMEOUT_S = 60.0  # after a push, how long to wait for slow sockets to take the rest
SLICE_S = 0.01  # how long to push without looking at the sockets (when behind, or at rate 0)


def frame(payload: bytes) -> bytes:
    """An unmasked, final text frame (RFC 6455 5.2), as a server sends it."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 1 << 16:
        return bytes((0x81, 126)) + n.to_bytes(2, "big") + payload
    return bytes((0x81, 127)) + n.to_bytes(8, "big") + payload


def change_message(sub_id: str, row: dict[str, Any], position: str) -> bytes:
    """A `change` as the hub sends it for an upsert of a `customers` row (compact JSON, the
    position last: the fleet finds it there)."""
    message = {
        "type": "change",
        "id": sub_id,
        "op": "upsert",
        "key": {"customer_id": row["customer_id"]},
        "row": row,
        "position": position,
    }
    return json.dumps(message, separators=(",", ":")).encode()


@dataclass
class Peer:
    """One websocket: its protocol state for what it sends us, and what it has yet to take."""

    sock: socket.socket
    ws: WSConnection = field(default_factory=lambda: WSConnection(ConnectionType.SERVER))
    pending: bytearray = field(default_factory=bytearray)
    text: str = ""
    sub_id: str | None = None  # subscribed, under this id
    closed: bool = False


class Server:
    """The single-threaded pusher: accepts, answers subscribes, and pushes on command."""

    def __init__(self, control_in: IO[bytes], control_out: IO[str]) -> None:
        self.selector = selectors.DefaultSelector()
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, LISTENER)
        self.control_in, self.control_out = control_in, control_out
        os.set_blocking(control_in.fileno(), False)
        self.selector.register(control_in, selectors.EVENT_READ, CONTROL)
        self.control_buf = b""
        self.peers: list[Peer] = []
        self.backlogged = 0  # peers with bytes pending
        self.sent = 0  # changes pushed so far (positions stay unique across pushes)
        self.quitting = False

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> None:
        self._answer({"port": self.port})
        while not self.quitting:
            self.poll(timeout=1.0)

    def poll(self, timeout: float | None) -> None:
        """One round of the selector: accept, read, write what sockets can take, commands."""
        for key, mask in self.selector.select(timeout):
            if key.data == LISTENER:
                self._accept()
            elif key.data == CONTROL:
                self._control()
            else:
                peer: Peer = key.data
                if mask & selectors.EVENT_READ:
                    self._read(peer)
                if mask & selectors.EVENT_WRITE and not peer.closed:
                    self._flush(peer)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                sock, _ = self.listener.accept()
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = Peer(sock)
                self.peers.append(peer)
                self.selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.ws.receive_data(data)
        for event in peer.ws.events():
            self._event(peer, event)

    def _event(self, peer: Peer, event: Event) -> None:
        if isinstance(event, Request):
            self.write(peer, peer.ws.send(AcceptConnection()))
        elif isinstance(event, TextMessage):
            peer.text += event.data
            if event.message_finished:
                self._message(peer, json.loads(peer.text))
                peer.text = ""
        elif isinstance(event, Ping):
            self.write(peer, peer.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            with contextlib.suppress(Exception):
                self.write(peer, peer.ws.send(event.response()))
            self._drop(peer)

    def _message(self, peer: Peer, message: dict[str, Any]) -> None:
        """A `subscribe` gets an (empty) snapshot: the fleet waits for one; nothing else is
        expected from clients here."""
        if message.get("op") == "subscribe":
            peer.sub_id = str(message.get("id"))
            snapshot = {"type": "snapshot", "id": peer.sub_id, "rows": [], "position": "0.0"}
            self.write(peer, frame(json.dumps(snapshot, separators=(",", ":")).encode()))

    def _drop(self, peer: Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        if peer.pending:
            peer.pending.clear()
            self.backlogged -= 1
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(peer.sock)
        peer.sock.close()

    # -- writing ----------------------------------------------------------------------------

    def write(self, peer: Peer, data: bytes) -> None:
        """Write now what the socket takes; keep the rest, in order, until it is writable."""
        if peer.closed:
            return
        if peer.pending:
            peer.pending += data
            return
        try:
            sent = peer.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(peer)
            return
        if sent < len(data):
            peer.pending += data[sent:]
            self.backlogged += 1
            self.selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def _flush(self, peer: Peer) -> None:
        try:
            sent = peer.sock.send(peer.pending)
        except BlockingIOError:
            return
        except OSError:
            self._drop(peer)
            return
        del peer.pending[:sent]
        if not peer.pending:
            self.backlogged -= 1
            self.selector.modify(peer.sock, selectors.EVENT_READ, peer)

    def broadcast(self, row: dict[str, Any], position: str) -> int:
        """One change to every subscriber: serialised and framed once per subscription id
        (the fleet's all share one), then the same bytes written to each socket."""
        frames: dict[str, bytes] = {}
        size = 0
        for peer in self.peers:
            if peer.sub_id is None or peer.closed:
                continue
            data = frames.get(peer.sub_id)
            if data is None:
                payload = change_message(peer.sub_id, row, position)
                data = frames[peer.sub_id] = frame(payload)
                size = len(payload)
            self.write(peer, data)
        return size

    # -- pushing ----------------------------------------------------------------------------

    def push(
        self, rate: float, duration: float, rows: list[dict[str, Any]], lsn: int
    ) -> dict[str, Any]:
        """Changes to every subscriber at `rate` per second (0: as fast as the sockets take
        them) for `duration` seconds; each change's decision time by its position."""
        decided: dict[str, float] = {}
        size = 0
        start = polled = time.time()
        end = start + duration
        i = 0
        while (now := time.time()) < end:
            if now - polled > SLICE_S:  # behind schedule, or at rate 0: let sockets drain
                self.poll(timeout=0)
                polled = now
            if not self._turn(start + i / rate if rate > 0 else None, end):
                continue
            position = f"{lsn + self.sent + i}.0"
            row = dict(rows[i % len(rows)])
            row["version"] = int(row.get("version") or 0) + 1 + i // len(rows)
            decided[position] = time.time()
            size = self.broadcast(row, position) or size
            i += 1
        self.sent += i
        self._drain()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "sent": i,
            "decided": decided,
            "message_bytes": size,
            "cpu_s": usage.ru_utime + usage.ru_stime,
        }

    def _turn(self, due: float | None, end: float) -> bool:
        """Whether the next change goes now: on a schedule, when it is `due`; at saturation
        (`due` None), when no socket has anything left in this process. Otherwise wait on the
        sockets (a while, not past `end`) and say no."""
        now = time.time()
        if due is not None and due > now:
            self.poll(timeout=min(due, end) - now)
            return False
        if due is None and self.backlogged:
            self.poll(timeout=SLICE_S)
            return False
        return True

    def _drain(self) -> None:
        """Write what the sockets have yet to take (bounded: a stuck client is not waited on)."""
        give_up = time.monotonic() + FLUSH_TIMEOUT_S
        while self.backlogged and time.monotonic() < give_up:
            self.poll(timeout=0.1)

    # -- control ----------------------------------------------------------------------------

    def _control(self) -> None:
        try:
            data = os.read(self.control_in.fileno(), 1 << 20)
        except BlockingIOError:
            return
        if not data:  # the parent is gone
            self.quitting = True
            return
        self.control_buf += data
        while b"\n" in self.control_buf:
            line, _, self.control_buf = self.control_buf.partition(b"\n")
            self._command(json.loads(line))

    def _command(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "status":
            live = [p for p in self.peers if not p.closed]
            self._answer(
                {
                    "clients": len(live),
                    "subscribed": sum(p.sub_id is not None for p in live),
                    "closed": len(self.peers) - len(live),
                }
            )
        elif op == "push":
            rows = command["rows"]
            self._answer(self.push(command["rate"], command["duration"], rows, command["lsn"]))
        elif op == "quit":
            for peer in list(self.peers):
                self._drop(peer)
            self.quitting = True
            self._answer({})
        else:
            self._answer({"error": f"unknown op {op!r}"})

    def _answer(self, answer: dict[str, Any]) -> None:
        self.control_out.write(json.dumps(answer) + "\n")
        self.control_out.flush()


class Ceiling:
    """The parent's handle on a ceiling server in a subprocess."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self._read()["port"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}/ws{query}"

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the ceiling server ended (exit code {self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.ask("quit")
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1 << 16)), hard))
    Server(sys.stdin.buffer, sys.stdout).serve()


if __name__ == "__main__":
    main()
