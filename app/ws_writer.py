"""One writer for every websocket of an API process.

A websocket used to have a sender thread of its own, woken for each message: at fan-out (a change
to a thousand subscribers) that is a thousand wake-ups and context switches per change, and a
thread per socket. Instead, the hub queues messages in each client's bounded outbox (app/hub.py,
unchanged: the same bounds, `lagging` and close 4008), the client tells this writer it has
something, and the writer's one thread frames what each such client has and writes it with one
non-blocking send. A socket that does not take it all keeps the rest here and is written again
when it can take more (a selector says when); meanwhile its outbox fills, and the hub's
slow-consumer policy applies as before. What falls behind costs its own outbox, never the writer.

Every byte sent on a registered socket goes through its `Outlet`, in order: the frames of
messages, and the control frames (pong, close) the websocket library sends while the
connection's handler reads, which see the socket through `SocketProxy`. Two writers never
interleave on one socket.

The writer also looks for sockets idle for `heartbeat_s` and has them sent a heartbeat (one
frame, the same bytes for every socket) by a thread of the operating system's own (`Beater`),
writes in slices (yielding between them, so that requests are served during a fan-out to
thousands of sockets), and hands a subscription's `resync` (a new snapshot: a database read) to
a small pool, never doing it on its own thread.

Why heartbeats have a thread of their own: ten thousand idle sockets are a thousand heartbeats a
second, each a system call that also delivers the bytes to the reader. Under the gevent worker
every greenlet, REST requests included, runs on one thread, so those sends (in slices between
requests) moved the REST p99 by most of a millisecond. On a thread of its own the send runs on
the other core without the interpreter's lock, and the requests' thread gives way to it only for
the few Python steps around each send. While a heartbeat is in flight the writer does not write
to that socket (`Outlet.beating`): the thread writes a whole frame or says what it left, which
the writer sends before anything else."""

from __future__ import annotations

import _queue
import _socket
import _thread
import contextlib
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, TextMessage
from wsproto.frame_protocol import FrameProtocol

from app.hub import Client, compact

log = logging.getLogger(__name__)

# How often idle sockets are looked at for heartbeats: ten times a second, so that ten thousand
# idle sockets (a thousand heartbeats a second at the default 10 s) are a hundred per sweep,
# not a thousand at once that a REST request arriving meanwhile waits behind.
SWEEP_S = 0.1
# Sockets written between two yields of the writer's thread (to the gevent worker's other
# greenlets, or the GIL): a change to ten thousand subscribers is written in slices, and a REST
# request in between waits for one slice (about a millisecond), not the whole fan-out. The
# yield is a sleep, however short: gevent's `sleep(0)` may resume the writer before the loop
# polls for I/O, so a request that has just arrived would still wait.
SLICE = 64
LOOK_SLICE = 32  # idle sockets looked at between two yields (a few microseconds each)
YIELD_S = 1e-6
# A server's frames are not masked: a heartbeat is the same bytes on every socket.
HEARTBEAT = bytes(
    FrameProtocol(client=False, extensions=[]).send_data('{"type":"heartbeat"}', fin=True)
)


class Outlet:
    """One websocket's side of the writer: frames its client's messages and keeps the bytes its
    socket has not taken yet."""

    def __init__(
        self,
        writer: Writer,
        ws: Any,  # simple_websocket's connection: its wsproto state frames messages
        client: Client,
        resubscribe: Callable[[str], None],
    ) -> None:
        self.writer, self.ws, self.client, self.resubscribe = writer, ws, client, resubscribe
        self.sock = _unwrapped(ws.sock)
        self.pending = bytearray()
        self.lock = threading.Lock()
        self.last_write = time.monotonic()
        self.closing = False  # the close frame is queued: nothing more is sent after it
        self.detached = False
        self.broken = False
        self.waiting_writable = False
        self.beating = False  # a heartbeat is in the Beater's hands: the writer keeps off
        self.woken_while_beating = False
        self.finished = threading.Event()  # done: detached with nothing left, or broken

    def enqueue(self, data: bytes) -> None:
        """Bytes another part of the connection sends (the library's pong and close frames)."""
        with self.lock:
            if not self.closing:
                self.pending += data
        self.writer.wake(self)

    def take_for_beat(self) -> bool:
        """Hand the socket to the `Beater` for a heartbeat, if it is idle and nothing waits to
        be written to it. Until `beaten`, the writer does not write to it."""
        with self.lock:
            if self.closing or self.broken or self.pending or self.beating:
                return False
            self.beating = True
            return True

    def beaten(self, sent: int, now: float) -> bool:
        """The `Beater` wrote `sent` bytes of the heartbeat; what it left goes first. True when
        the writer has something to do here (a wake while the heartbeat was in flight, or the
        heartbeat's rest)."""
        with self.lock:
            self.beating = False
            if sent == len(HEARTBEAT):
                self.last_write = now
            elif not self.broken:
                self.pending[0:0] = HEARTBEAT[sent:]
            woken, self.woken_while_beating = self.woken_while_beating, False
            return woken or bool(self.pending)

    def pump(self) -> None:
        """Frame what the client has queued and write as much as the socket takes; once the
        client is closed and its last messages are framed, its close frame. While the socket
        has not taken what it was given, the messages stay in the client's outbox: that is
        where a slow reader's backlog is bounded (`lagging`, then 4008)."""
        self.flush()
        if self.pending and self.client.close_code is None:
            return  # written again when the socket can take more
        if not self.ws.connected or self.ws.ws.state != ConnectionState.OPEN:
            # Closed by the library (the client's close, or the server's own after the handler):
            # nothing more can be framed.
            self.client.take(0)
            self._after(bytearray(), closing=True)
            return
        frames = bytearray()
        closing = False
        while True:
            taken = self.client.take(0)
            if taken is None:  # closed, and nothing is left to send
                closing = not self.closing
                code = self.client.close_code or 1000
                if closing and code not in (1000, 1006):
                    reason = self.client.close_reason[:120]
                    frames += self.ws.ws.send(CloseConnection(code=code, reason=reason))
                    self.ws.connected = False  # as the library's own close() leaves it
                break
            for message in taken:
                if isinstance(message, str):  # a change, encoded once for its subscribers
                    frames += self.ws.ws.send(TextMessage(data=message))
                elif message["type"] == "_resubscribe":
                    self.writer.pool.submit(self._resubscribe, message["id"])
                else:
                    text = compact(message)
                    frames += self.ws.ws.send(TextMessage(data=text))
            if not taken or self.client.close_code is None:
                break  # (a closed client: once more, for its close frame)
        self._after(frames, closing)

    def _resubscribe(self, sub_id: str) -> None:
        try:
            self.resubscribe(sub_id)
        except Exception:  # a bug: logged; the subscription stays without a snapshot
            log.exception("resubscribing %s failed", sub_id)

    def _after(self, frames: bytearray, closing: bool = False) -> None:
        with self.lock:
            if frames and not self.closing:
                self.pending += frames
            self.closing = self.closing or closing
        self.flush()

    def flush(self) -> None:
        """Write what is pending without blocking; what the socket does not take waits for it
        to be writable."""
        with self.lock:
            while self.pending and not self.broken:
                try:
                    sent = self.sock.send(self.pending, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self.broken = True
                    self.pending.clear()
                    self.client.close(1006, "connection lost")
                    break
                del self.pending[:sent]
                self.last_write = time.monotonic()
            waiting = bool(self.pending) and not self.broken
        self.writer.want_writable(self, waiting)

    def abandon(self) -> None:
        """Give up on what is pending (the connection is being closed under it)."""
        with self.lock:
            self.broken = True
            self.pending.clear()

    @property
    def done(self) -> bool:
        """Nothing more will be written: detached (or broken) with nothing left, and no
        heartbeat in flight (its socket is closed once this says so)."""
        return not self.beating and (self.broken or (self.detached and not self.pending))


def _unwrapped(sock: Any) -> _socket.socket:
    """The socket to write with, sends never waiting: a plain socket (sent with MSG_DONTWAIT),
    or the C-level socket under a gevent one, whose own send would wait for room and so hold up
    every other socket behind a slow one."""
    inner = getattr(sock, "_sock", None)
    if isinstance(inner, _socket.socket):
        return inner
    if not isinstance(sock, _socket.socket):
        raise TypeError(f"cannot write to {type(sock).__name__} without waiting")
    return sock


class SocketProxy:
    """The socket as the websocket library sees it once its connection is registered: sends go
    through the outlet (in order with the writer's frames); everything else is the socket's."""

    def __init__(self, sock: socket.socket, outlet: Outlet) -> None:
        self._sock, self._outlet = sock, outlet

    @property
    def wrapped(self) -> socket.socket:
        """The socket itself (a plain one, or gevent's)."""
        return self._sock

    def send(self, data: bytes) -> int:
        self._outlet.enqueue(bytes(data))
        return len(data)

    def sendall(self, data: bytes) -> None:
        self._outlet.enqueue(bytes(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _start_os_thread(target: Callable[[], None]) -> None:
    """Run `target` on a thread of the operating system's own, even in a process gevent has
    patched (where a `threading.Thread` is a greenlet on the one thread)."""
    try:
        from gevent.monkey import get_original
    except ImportError:  # pragma: no cover (gevent is a dependency: the default worker)
        start = _thread.start_new_thread
    else:
        start = get_original("_thread", "start_new_thread")
    start(target, ())


class Beater:
    """Writes heartbeats, on a thread of its own, to the sockets the writer hands it (in
    batches: those due at one look). It touches nothing of an outlet but its socket, with one
    non-blocking send of the heartbeat, and hands back how much each took; it wakes the writer
    through `wake` (a C-level socket: nothing here may wait on the gevent hub, which is the
    other thread's). Its queues are the standard library's C ones, which gevent leaves alone."""

    def __init__(self, wake: _socket.socket) -> None:
        self._wake = wake
        self._todo: _queue.SimpleQueue[list[Outlet] | None] = _queue.SimpleQueue()
        self._done: _queue.SimpleQueue[tuple[Outlet, int]] = _queue.SimpleQueue()
        _start_os_thread(self._run)

    def beat(self, outlets: list[Outlet]) -> None:
        self._todo.put(outlets)

    def stop(self) -> None:
        self._todo.put(None)

    def beaten(self) -> list[tuple[Outlet, int]]:
        """What the thread has written since the last call: each outlet, and the bytes sent."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except _queue.Empty:
                return out

    def _run(self) -> None:
        while (batch := self._todo.get()) is not None:
            for outlet in batch:
                try:
                    sent = outlet.sock.send(HEARTBEAT, socket.MSG_DONTWAIT)
                except OSError:  # full, or gone: the writer's next write says which
                    sent = 0
                self._done.put((outlet, sent))
            with contextlib.suppress(OSError):
                self._wake.send(b"\0", socket.MSG_DONTWAIT)


class Writer:
    """The process's websocket writer: one thread, a selector for sockets that are full."""

    def __init__(self, heartbeat_s: float, snapshot_workers: int = 4) -> None:
        self.heartbeat_s = heartbeat_s
        self.pool = ThreadPoolExecutor(snapshot_workers, thread_name_prefix="ws-resubscribe")
        self.outlets: set[Outlet] = set()
        self.dirty: set[Outlet] = set()
        self.lock = threading.Lock()
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._signalled = False
        self._beater: Beater | None = None
        # When each outlet is next looked at for a heartbeat, soonest first: a sweep looks at
        # the sockets due, not at every socket (ten thousand idle ones, every second, took a
        # twentieth of the process).
        self._due: list[tuple[float, int, Outlet]] = []
        self._order = itertools.count()  # (ties: never compare outlets)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()
        self.written = 0  # messages framed (for tests and metrics)

    def start(self) -> None:
        with self._started:
            if self._thread is None:
                self._beater = Beater(_unwrapped(self._wake_w))
                self._thread = threading.Thread(target=self._run, name="ws-writer", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._signal()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._beater is not None:
            self._beater.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- connections ---------------------------------------------------------------------------

    def attach(self, ws: Any, client: Client, resubscribe: Callable[[str], None]) -> Outlet:
        """Register a connection: from now on every byte sent on its socket goes through here."""
        self.start()
        outlet = Outlet(self, ws, client, resubscribe)
        ws.sock = SocketProxy(ws.sock, outlet)
        client.listener = lambda: self.wake(outlet)
        with self.lock:
            self.outlets.add(outlet)
            self.dirty.add(outlet)  # what was queued before it was registered
            self._schedule(outlet, time.monotonic() + self.heartbeat_s)
        self._signal()
        return outlet

    def detach(self, outlet: Outlet, linger: float = 0.0) -> None:
        """The connection ends: what is pending is still written (its close frame; waiting at
        most `linger` for it, as the server closes the socket once the handler returns), then
        the outlet is dropped."""
        outlet.detached = True
        self.wake(outlet)
        if linger > 0 and not outlet.finished.wait(linger):
            outlet.abandon()  # the client does not read: its socket is closed without it
            self.wake(outlet)
            # (not while a heartbeat is being sent to it: its number could meanwhile be another
            # connection's. The Beater's batches take milliseconds.)
            outlet.finished.wait(linger)

    def wake(self, outlet: Outlet) -> None:
        with self.lock:
            self.dirty.add(outlet)
        self._signal()

    def want_writable(self, outlet: Outlet, waiting: bool) -> None:
        with self.lock:
            if waiting == outlet.waiting_writable:
                return
            outlet.waiting_writable = waiting
            try:
                if waiting:
                    self.selector.register(outlet.sock, selectors.EVENT_WRITE, outlet)
                else:
                    self.selector.unregister(outlet.sock)
            except (KeyError, ValueError, OSError):
                outlet.waiting_writable = False

    def _signal(self) -> None:
        if self._signalled:
            return
        self._signalled = True
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while not self._stopping:
            try:
                ready = self.selector.select(max(0.0, next_sweep - time.monotonic()))
            except OSError:  # a registered socket was closed meanwhile
                ready = []
                self._forget_closed()
            writable: list[Outlet] = []
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                else:
                    writable.append(key.data)
            with self.lock:
                self._signalled = False
                dirty, self.dirty = self.dirty, set()
            assert self._beater is not None
            now = time.monotonic()
            for outlet, sent in self._beater.beaten():
                if outlet.beaten(sent, now):
                    dirty.add(outlet)
            due = [*dirty, *(o for o in writable if o not in dirty)]
            for pumped, outlet in enumerate(due, start=1):
                self._pump(outlet)
                if pumped % SLICE == 0:
                    time.sleep(YIELD_S)  # let the process's requests in between slices
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                self._sweep(now)

    def _pump(self, outlet: Outlet) -> None:
        if outlet.beating:  # the Beater has its socket: pumped once it hands it back
            outlet.woken_while_beating = True
            return
        try:
            if not outlet.broken:
                outlet.pump()  # detached too: its last messages and its close frame go first
        except Exception:  # a bug: this connection is cut, the others go on
            log.exception("websocket writer: writing to a connection failed; it is closed")
            outlet.broken = True
            outlet.client.close(1011, "internal error")
        if outlet.done:
            self.want_writable(outlet, False)
            with self.lock:
                self.outlets.discard(outlet)
            outlet.finished.set()

    def _schedule(self, outlet: Outlet, when: float) -> None:
        """Look at `outlet` for a heartbeat at `when`. Holds the lock."""
        heapq.heappush(self._due, (when, next(self._order), outlet))

    def _sweep(self, now: float) -> None:
        """Heartbeats for the sockets idle for `heartbeat_s`; outlets that are done go."""
        due: list[Outlet] = []
        with self.lock:
            while self._due and self._due[0][0] <= now:
                due.append(heapq.heappop(self._due)[2])
        later, beats = [], []
        for seen, outlet in enumerate(due, start=1):
            if seen % LOOK_SLICE == 0:
                time.sleep(YIELD_S)  # (many due at once: in slices, as `_run` writes)
            if outlet not in self.outlets:  # gone since
                continue
            if outlet.done:
                self._pump(outlet)  # (it goes)
                continue
            if now - outlet.last_write >= self.heartbeat_s:
                if outlet.ws.connected and outlet.take_for_beat():
                    beats.append(outlet)
                later.append((outlet, now + self.heartbeat_s))
            else:  # written to since: due a heartbeat_s after that
                later.append((outlet, outlet.last_write + self.heartbeat_s))
        if beats:
            assert self._beater is not None
            self._beater.beat(beats)
        with self.lock:
            for outlet, when in later:
                if outlet in self.outlets:
                    self._schedule(outlet, when)

    def _forget_closed(self) -> None:
        with self.lock:
            for outlet in list(self.outlets):
                if outlet.sock.fileno() == -1:
                    outlet.broken = True
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(outlet.sock)
                    outlet.waiting_writable = False
                    self.outlets.discard(outlet)
                    outlet.finished.set()
