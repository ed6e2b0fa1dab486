"""Pushing view changes to websocket subscribers: the hub, its clients and their subscriptions.

The hub follows the `cdc.<table>` changelogs (one consumer per API process) and hands each change
to the subscriptions it concerns. Every change carries its position in the WAL, so:

- a subscription starts with a snapshot read in a REPEATABLE READ transaction (nothing is
  locked; writers go on), then gets exactly the changes of the transactions that snapshot does
  not see: every change carries its transaction id, and `pg_current_snapshot()` says which
  transactions the rows include (below xmin: ended; from xmax on, or running: not included).
  The hub serves it only while its history holds every transaction from the snapshot's xmin
  on; otherwise the connection takes a new snapshot. (A hub that started mid-changelog has
  not seen what came before its history: a transaction among those is one that committed
  before the hub started, so every snapshot taken once the hub is ready sees it.)
- a client that reconnects with `since` gets the changes after it from the hub's recent history
  (the last `LOGFOLD_WS_REPLAY` changes of each table, refilled from Kafka on start), or a
  `resync` when its position is older than that;
- a resent change (CDC restarted) is at or below the table's last position and is dropped.

When following the changelogs fails, the hub starts again right after the last record it took
of each changelog: nothing is skipped, however much arrived meanwhile. Where it cannot, the
table's history has a break, and each subscription of that table gets `resync` and a new
snapshot (and a `since` from before the break gets `resync`): records it had not read were
removed (deleted, the topic made again, or compacted: a hole in the offsets, as CDC writes one
offset per record), or a record cannot be decoded. Such a record is counted (`/health`'s `live`
component, `/metrics`), logged once with its topic, partition and offset, and skipped: never
retried, so it cannot hold the others up. The new snapshot is read after the break was seen, so
it holds whatever the missing records changed (they were committed before they were written).

Each client has a bounded outbox that the hub appends to without ever blocking; the client's own
thread drains it into the socket. It is bounded in messages and in bytes (a change weighs its
changelog record, a snapshot its rows). A client whose outbox passes half of either bound gets
`lagging`; one that fills it is closed with code 4008 and its outbox is dropped, so one slow
reader costs the others nothing and memory stays bounded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from cdc.changes import Change, Snapshot, WalPosition, from_record, seen_as, widen
from config.settings import IDLE_POLL_MS, KAFKA_REQUEST_TIMEOUT_MS, kafka_consumer_options
from events.base import ERASED

log = logging.getLogger(__name__)

SLOW_CLOSE = 4008
GOING_AWAY = 1001  # the process is stopping: reconnect (to another node) and resume
GOING_AWAY_MESSAGE = "this API node is stopping: reconnect and resume with `since`"
SMALL_MESSAGE_BYTES = 128  # what a message without rows counts for in the outbox's byte bound
FLOOR = WalPosition(0, 0)
UNKNOWN = WalPosition(2**63, 0)  # above every position: nothing can be served yet

Message = dict[str, Any] | str  # a message to encode, or its text (a change, encoded once)


@dataclass(eq=False)
class Subscription:
    id: str
    view: str
    table: str
    projection: str
    filter: dict[str, Any]  # column -> value in wire form
    client: Client
    after: WalPosition = FLOOR  # the last position this subscription has been sent
    # Started from a snapshot: the changes of the transactions it sees are in it already.
    snapshot: Snapshot | None = None
    id_json: str = field(init=False, repr=False)

    def has(self, change: Change) -> bool:
        """Whether this subscription has `change` already (in its snapshot, or sent)."""
        if self.snapshot is not None and self.snapshot.sees(change.xid):
            return True
        return change.position <= self.after

    def __post_init__(self) -> None:
        self.id_json = compact(self.id)  # spliced into every change message it is sent

    def op_for(self, change: Change) -> str | None:
        """`upsert`, `delete`, or None when the change does not concern this subscription."""
        return seen_as(self.filter, change)

    def message_for(self, change: Change, encoded: Encoded | None = None) -> str | None:
        """The `change` message for this subscription, as the text sent; None when the change
        does not concern it. `encoded`: the change's bodies, shared by its subscriptions."""
        op = self.op_for(change)
        if op is None:
            return None
        return (encoded or Encoded(change)).message(op, self.id_json)


class Encoded:
    """A change's `change` messages, encoded once for every subscription it concerns: each
    subscription's message splices its own id into the same text (fan-out costs one encoding
    per change and op, not one per subscriber). Sent as is by websockets, and as the data of
    server-sent events."""

    __slots__ = ("_tails", "change")

    HEAD = '{"type":"change","id":'

    def __init__(self, change: Change) -> None:
        self.change = change
        self._tails: dict[str, str] = {}

    def message(self, op: str, id_json: str) -> str:
        tail = self._tails.get(op)
        if tail is None:
            c = self.change
            body = {"op": op, "key": c.key, "row": c.row if op == "upsert" else None}
            # the position last: clients may find it without decoding the rest
            body["position"] = str(c.position)
            tail = self._tails[op] = "," + compact(body)[1:]
        return self.HEAD + id_json + tail


def compact(value: Any) -> str:
    """JSON as every push message is sent: without spaces."""
    return json.dumps(value, separators=(",", ":"))


class Client:
    """One websocket connection's side of the hub: a bounded outbox and its close state."""

    def __init__(self, buffer: int, buffer_bytes: int = 16 * 1024 * 1024) -> None:
        self.buffer, self.buffer_bytes = buffer, buffer_bytes
        # Messages to send: dicts, or texts already encoded (changes, shared by subscribers).
        # (A list: it is only ever appended to and taken whole; an empty deque would cost a
        # block of 64 slots for each of thousands of idle sockets.)
        self.outbox: list[Message] = []
        self.queued_bytes = 0  # what the queued messages weigh, roughly
        self.cond = threading.Condition()
        self.close_code: int | None = None
        self.close_reason = ""
        self.closing_since = 0.0
        self.warned = False
        self.peak = 0
        self.subscriptions: dict[str, Subscription] = {}
        # Told (without arguments, never blocking) whenever there is something to send: the
        # process's websocket writer (app/ws_writer.py) then writes it.
        self.listener: Callable[[], None] | None = None

    def offer(self, message: Message, sub_id: str | None = None, weight: int = 0) -> bool:
        """Queue a message without blocking; False once the client is being closed. The outbox
        is bounded in messages and in bytes (`weight`: what the message weighs, e.g. a
        snapshot's rows; small messages count as SMALL_MESSAGE_BYTES)."""
        weight = max(weight, SMALL_MESSAGE_BYTES)
        with self.cond:
            if self.close_code is not None:
                return False
            full = len(self.outbox) >= self.buffer
            if full or self.queued_bytes + weight > self.buffer_bytes:
                self._close(SLOW_CLOSE, "too far behind: read faster, then resume with `since`")
                closed = True
            else:
                closed = False
                self._queue(message, sub_id, weight)
        if self.listener is not None:
            self.listener()
        return not closed

    def _queue(self, message: Message, sub_id: str | None, weight: int) -> None:
        """Append `message` (and, past half of a bound, the `lagging` warning). Holds cond."""
        self.outbox.append(message)
        self.queued_bytes += weight
        half = len(self.outbox) >= self.buffer // 2 or self.queued_bytes >= self.buffer_bytes // 2
        if not self.warned and half:
            self.warned = True
            self.outbox.append({"type": "lagging", "id": sub_id, "behind": len(self.outbox)})
            self.queued_bytes += SMALL_MESSAGE_BYTES
        self.peak = max(self.peak, len(self.outbox))
        self.cond.notify()

    def close(self, code: int, reason: str, farewell: dict[str, Any] | None = None) -> None:
        """Close with `code`: what is queued is dropped but the `lagging` warning and
        `farewell` (an error saying why), which are sent before the close."""
        with self.cond:
            if self.close_code is None:
                self._close(code, reason, farewell)
        if self.listener is not None:
            self.listener()

    def _close(self, code: int, reason: str, farewell: dict[str, Any] | None = None) -> None:
        self.close_code, self.close_reason = code, reason
        self.closing_since = time.monotonic()
        # What it could not read is dropped (it resumes with `since`), but not the warning.
        warnings = [m for m in self.outbox if isinstance(m, dict) and m["type"] == "lagging"]
        self.outbox = [*warnings[:1], *([farewell] if farewell else [])]
        self.queued_bytes = SMALL_MESSAGE_BYTES * len(self.outbox)
        self.cond.notify()

    def take(self, timeout: float) -> list[Message] | None:
        """Everything queued (waiting up to `timeout`); [] on timeout; None once closing and
        nothing is left to send."""
        with self.cond:
            if not self.outbox and self.close_code is None:
                self.cond.wait(timeout)
            if self.close_code is not None and not self.outbox:
                return None
            taken, self.outbox = self.outbox, []
            self.queued_bytes = 0
            self.warned = False  # caught up: falling behind again earns a new warning
            return taken


@dataclass
class _Table:
    ring: deque[Change]
    last: WalPosition = FLOOR  # the newest position seen (older ones are resends)
    served_from: WalPosition | None = None  # `since` at or after this can be served; None: any
    subscriptions: set[Subscription] = field(default_factory=set)
    newest_xid: int | None = None  # of the changes seen, widened to 64 bits as they come
    dropped_xid: int | None = None  # the newest transaction of the changes dropped from the ring
    next_offset: int | None = None  # in its changelog, after the last record taken; None: unread
    # The CDC slot's first snapshot, once its rows were seen: a reader's snapshot that does not
    # cover it was read before the slot existed (the changes in between were never streamed).
    initial: Snapshot | None = None
    # Notified (under the hub's lock) whenever changes of the table arrive or its history
    # breaks: long-polls wait on it.
    changed: threading.Condition | None = None

    def widened(self, xid: int) -> int:
        return widen(xid, self.newest_xid if self.newest_xid is not None else xid)


class Unservable(Exception):
    """The position is older than the hub's history of the table: the client must resync."""


REAP_EVERY_S = 2.0  # how often clients closed for being slow are looked at (`Hub._reap`)


class Hub:
    def __init__(
        self,
        bootstrap: str,
        topics: dict[str, str],  # table -> its cdc topic
        replay: int,
        progress_table: str = "projection_progress",
    ) -> None:
        self.bootstrap, self.topic_of, self.replay = bootstrap, topics, replay
        self.progress_table = progress_table
        self.lock = threading.Lock()
        self.tables = {t: _Table(deque(), changed=threading.Condition(self.lock)) for t in topics}
        self.generations: dict[str, int] = {}
        self.ready = threading.Event()
        self.clients: set[Client] = set()
        self.delivered = 0
        self.failures = 0  # times following the changelogs failed (it then resumed)
        self.failing: str | None = None  # the last failure, until a poll succeeds again
        self.undecodable = 0  # changelog records that could not be decoded (skipped)
        self.last_undecodable: dict[str, Any] | None = None  # where the last one was
        self.resyncs = 0  # subscriptions sent `resync` because their table's history broke
        self._next_reap = 0.0  # (monotonic) when `_reap` next looks at the clients
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        with self._started:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="live-hub", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._follow()
            except Exception as e:
                self.failures += 1
                self.failing = f"{type(e).__name__}: {e}"
                log.exception("live hub: following the changelogs failed; resuming where it was")
                self._stopping.wait(1.0)

    def _follow(self) -> None:
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            metrics_enabled=False,
            enable_auto_commit=False,
            group_id=None,
            # How long the broker holds a fetch when there is nothing new: a change that
            # arrives meanwhile is answered at once, so this only sets how often an idle hub
            # asks (as often as it polls).
            fetch_max_wait_ms=IDLE_POLL_MS,
            max_poll_records=500,  # smaller bursts into the outboxes
            request_timeout_ms=KAFKA_REQUEST_TIMEOUT_MS,
            **kafka_consumer_options(),
        )
        try:
            tps = {TopicPartition(topic, 0): table for table, topic in self.topic_of.items()}
            consumer.assign(list(tps))
            begins, ends = consumer.beginning_offsets(list(tps)), consumer.end_offsets(list(tps))
            for tp, table in tps.items():
                consumer.seek(tp, self._resume(table, tp, begins[tp], ends[tp]))
            pending = {tp for tp in tps if ends[tp] > consumer.position(tp)}
            if not pending:
                self.ready.set()
            while not self._stopping.is_set():
                batch = consumer.poll(timeout_ms=IDLE_POLL_MS)
                self.failing = None
                for tp, records in batch.items():
                    self._take(tps[tp], tp, records)
                if pending:
                    pending = {tp for tp in pending if consumer.position(tp) < ends[tp]}
                    if not pending:
                        self.ready.set()
                self._reap()
        finally:
            consumer.close()

    def _resume(self, table: str, tp: TopicPartition, begin: int, end: int) -> int:
        """Where to read `table`'s changelog (its log holds offsets `begin`..`end`) from: right
        after the last record taken; at the first start, its last `replay` records. When records
        after the last one taken are gone, the table's history breaks and what is left of the
        log is read from its start."""
        with self.lock:
            t = self.tables[table]
            done = t.next_offset
            if done is not None and begin <= done <= end:
                return done
            if done is None:
                start = max(begin, end - self.replay)
                # Starting mid-topic: only positions from the first record on are known.
                if start > begin and t.served_from is None and not t.ring:
                    t.served_from = UNKNOWN  # until the first record arrives
            else:
                start = begin
                self._break(t, f"{tp.topic}:{tp.partition} offsets from {done} on are gone")
            t.next_offset = start
            return start

    # -- changes ----------------------------------------------------------------------------

    def _take(self, table: str, tp: TopicPartition, records: Sequence[Any]) -> None:
        """Apply the next `records` (Kafka's) of `table`'s changelog, in order. A hole in the
        offsets before a record (records removed before the hub read them), or a record that
        cannot be decoded, breaks the table's history; an undecodable one is reported, skipped."""
        t = self.tables[table]
        run: list[Change] = []
        expected = t.next_offset  # only this thread moves it
        for r in records:
            if expected is not None and r.offset > expected:
                self._apply(table, run, expected)
                run = []
                with self.lock:
                    self._break(
                        t,
                        f"{tp.topic}:{tp.partition} offsets {expected}..{r.offset - 1} were "
                        "removed before the hub read them",
                    )
            expected = r.offset + 1
            try:
                change = _decode(table, r)
            except Exception as e:  # whatever the record holds: reported and skipped
                self._apply(table, run, r.offset)
                run = []
                self._undecodable(t, tp, r, e)
                continue
            run.append(change)
        self._apply(table, run, expected)

    def _undecodable(self, t: _Table, tp: TopicPartition, record: Any, error: Exception) -> None:
        """Count, log once and skip a record that cannot be decoded; its table's history breaks
        (what it changed is unknown). Its transaction, when its header says, counts as dropped
        from the history, as a snapshot that does not see it cannot be served."""
        where = {"topic": tp.topic, "partition": tp.partition, "offset": record.offset}
        log.error(
            "live hub: cannot decode the changelog record at %s:%d offset %d (%s: %s); skipped",
            tp.topic,
            tp.partition,
            record.offset,
            type(error).__name__,
            error,
        )
        with self.lock:
            self.undecodable += 1
            self.last_undecodable = {**where, "at": datetime.now(UTC).isoformat()}
            t.next_offset = record.offset + 1
            xid = _xid_of(record)
            if xid is not None:
                x = t.widened(xid)
                t.dropped_xid = x if t.dropped_xid is None else max(t.dropped_xid, x)
            self._break(t, f"{tp.topic}:{tp.partition} offset {record.offset} is undecodable")

    def _break(self, t: _Table, why: str) -> None:
        """`t`'s history misses changes (`why`): its subscriptions resync (a new snapshot),
        and a `since` from before the next change cannot be served. Holds the lock."""
        t.served_from = UNKNOWN  # until the next change
        if t.subscriptions:
            log.warning("live hub: %s; %d subscriptions resync", why, len(t.subscriptions))
        else:
            log.info("live hub: %s; its history starts after them", why)
        self.resyncs += len(t.subscriptions)
        self._resync(t, list(t.subscriptions))
        if t.changed is not None:
            t.changed.notify_all()

    def _resync(self, t: _Table, subs: Iterable[Subscription]) -> None:
        """`subs` leave the stream, get a `resync`, and their connection takes a new
        snapshot. Holds the lock."""
        for sub in subs:
            t.subscriptions.discard(sub)
            sub.client.offer({"type": "resync", "id": sub.id}, sub.id)
            sub.client.offer({"type": "_resubscribe", "id": sub.id}, sub.id)

    def _apply(self, table: str, changes: Iterable[Change], next_offset: int | None = None) -> None:
        """Apply `changes` of `table`; `next_offset`: where its changelog goes on after them."""
        with self.lock:
            t = self.tables[table]
            if next_offset is not None:
                t.next_offset = next_offset
            for change in changes:
                if change.position <= t.last:
                    continue  # resent by a restarted CDC process
                if change.snapshot is not None and change.snapshot != t.initial:
                    # The rows of a new slot's first snapshot: what changed before it was
                    # never streamed. Who read the table earlier takes a new snapshot.
                    t.initial = change.snapshot
                    self._break(t, f"{table}'s changelog starts from a new CDC slot's snapshot")
                if t.served_from == UNKNOWN:
                    t.served_from = change.position
                t.last = change.position
                if change.xid is not None:
                    t.newest_xid = max(t.newest_xid or 0, t.widened(change.xid))
                t.ring.append(change)
                if len(t.ring) > self.replay:
                    self._drop_oldest(t)
                if change.row is not None and ERASED in change.row.values():
                    # A data subject was erased (guarantee 27): older changes may hold its
                    # personal fields in clear, so none is sent again; a `since` from before
                    # this one gets `resync`, and a new snapshot with the erased rows.
                    while len(t.ring) > 1:
                        self._drop_oldest(t)
                encoded = Encoded(change)
                for sub in list(t.subscriptions):
                    if sub.has(change):
                        continue  # in its snapshot, or sent
                    message = sub.message_for(change, encoded)
                    if message is not None and sub.client.offer(message, sub.id, change.size):
                        sub.after = change.position
                        self.delivered += 1
                    elif sub.client.close_code is not None:
                        t.subscriptions.discard(sub)
                if table == self.progress_table:
                    self._rebuilt(change)
            if t.changed is not None:
                t.changed.notify_all()

    def _drop_oldest(self, t: _Table) -> None:
        """Forget the oldest change of `t`'s history: a `since` or a snapshot from before it
        can no longer be served. Holds the lock."""
        dropped = t.ring.popleft()
        if t.served_from is None or t.served_from < dropped.position:
            t.served_from = dropped.position  # (not back before a break)
        if dropped.xid is not None:
            x = t.widened(dropped.xid)
            t.dropped_xid = x if t.dropped_xid is None else max(t.dropped_xid, x)

    def _rebuilt(self, change: Change) -> None:
        """Subscriptions of a projection whose generation just changed (it was rebuilt) leave
        the stream, get a `resync`, and their connection takes a new snapshot."""
        if change.row is None:
            return
        try:
            name, generation = str(change.row["projection"]), int(change.row["generation"])
        except (KeyError, TypeError, ValueError):
            log.error("live hub: a projection_progress row without its generation at %s", change)
            return
        seen = self.generations.get(name)
        self.generations[name] = generation
        if seen is None or generation == seen:
            return
        for t in self.tables.values():
            self._resync(t, [s for s in t.subscriptions if s.projection == name])

    # -- subscriptions ----------------------------------------------------------------------

    def attach(self, client: Client) -> None:
        with self.lock:
            self.clients.add(client)

    def detach(self, client: Client) -> None:
        with self.lock:
            self.clients.discard(client)
            for t in self.tables.values():
                t.subscriptions -= set(client.subscriptions.values())

    def subscribe(
        self,
        sub: Subscription,
        after: WalPosition | Snapshot,
        first: dict[str, Any] | None = None,
        first_weight: int = 0,
    ) -> None:
        """Start streaming to `sub` the changes it does not have: those after the position
        `after`, or, from a snapshot, those of the transactions it does not see. Atomically
        queues `first` (the snapshot's rows) and the matching changes the hub already has.
        Raises Unservable when the hub's history of the table does not reach back far enough:
        before the position, or (snapshot) to every transaction the snapshot might not see."""
        with self.lock:
            t = self.tables[sub.table]
            self._check_servable(sub.table, after)
            if isinstance(after, Snapshot):
                sub.snapshot, sub.after = after, FLOOR
            else:
                sub.snapshot, sub.after = None, after
            if first is not None:
                sub.client.offer(first, sub.id, first_weight)
            for change in t.ring:
                if not sub.has(change):
                    message = sub.message_for(change)
                    if message is not None and sub.client.offer(message, sub.id, change.size):
                        sub.after = change.position
            t.subscriptions.add(sub)

    def page(
        self, sub: Subscription, since: WalPosition | Snapshot, limit: int, wait: float
    ) -> tuple[list[str], WalPosition | Snapshot]:
        """For a long-poll: the `change` messages of `sub` after `since` (at most `limit`, in
        order) and the position to ask from next; when there are none, waits up to `wait`
        seconds for the first. The next position is the last change returned; with none, a
        change position moves on to the newest change the hub has (none of those concerned
        `sub`), a snapshot stays as it is (changes it sees may still be on their way). Raises
        Unservable when the hub's history of the table does not reach back to `since`."""
        deadline = time.monotonic() + wait
        with self.lock:
            t = self.tables[sub.table]
            while True:
                self._check_servable(sub.table, since)
                if isinstance(since, Snapshot):
                    sub.snapshot, sub.after = since, FLOOR
                else:
                    sub.snapshot, sub.after = None, since
                found: list[str] = []
                for change in t.ring:
                    if len(found) >= limit:
                        break
                    if not sub.has(change):
                        message = sub.message_for(change)
                        if message is not None:
                            found.append(message)
                            sub.after = change.position
                if found:
                    return found, sub.after
                if isinstance(since, WalPosition) and t.last > since:
                    since = t.last  # nothing after `since` concerns `sub`
                left = deadline - time.monotonic()
                if left <= 0 or t.changed is None:
                    return [], since
                t.changed.wait(left)

    def _check_servable(self, table: str, after: WalPosition | Snapshot) -> None:
        """Raises Unservable when `table`'s history does not reach back to `after`: before the
        position, or (snapshot) to every transaction the snapshot might not see. Holds the
        lock."""
        t = self.tables[table]
        if isinstance(after, Snapshot):
            dropped = t.dropped_xid
            if dropped is not None and widen(dropped, after.xmax) >= after.xmin:
                raise Unservable(table)
            if t.initial is not None and not after.covers(t.initial):
                raise Unservable(table)  # read before the CDC slot existed
        elif t.served_from is not None and after < t.served_from:
            raise Unservable(table)

    def unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            self.tables[sub.table].subscriptions.discard(sub)

    def going_away(self) -> int:
        """The process is stopping: every client is told so (`error` `going_away`, then close
        code 1001 on a websocket; the end of a stream) and closed, so that it reconnects, through
        the load balancer to another node, and resumes where it was. How many there were."""
        with self.lock:
            clients = list(self.clients)
        for client in clients:
            farewell = {
                "type": "error",
                "id": None,
                "code": "going_away",
                "message": GOING_AWAY_MESSAGE,
            }
            client.close(GOING_AWAY, GOING_AWAY_MESSAGE, farewell)
        return len(clients)

    def _reap(self, grace: float = 10.0) -> None:
        """Clients closed for being slow whose socket stays blocked: cut them off. It looks at
        every client, so not at every round of the loop: with ten thousand idle sockets a look
        takes a millisecond, in which a REST request on the same process waits."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_EVERY_S
        with self.lock:
            stuck = [
                c
                for c in self.clients
                if c.close_code is not None and now - c.closing_since > grace
            ]
        for client in stuck:
            with client.cond:
                client.cond.notify_all()
            abort = getattr(client, "abort", None)
            if abort is not None:
                abort()

    def health(self) -> dict[str, Any]:
        """The hub as `/health` shows it (component `live`): down while following the
        changelogs fails (it then resumes where it was); the records it could not decode (each
        skipped, its table's subscribers resynced), the last one's place; the resyncs."""
        with self.lock:
            status: dict[str, Any] = {
                "status": "down" if self.failing else "up",
                "started": self._thread is not None,
                "ready": self.ready.is_set(),
                "failures": self.failures,
                "undecodable_records": self.undecodable,
                "resyncs": self.resyncs,
            }
            if self.last_undecodable is not None:
                status["last_undecodable"] = dict(self.last_undecodable)
            if self.failing:
                status["error"] = self.failing
        return status

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "clients": len(self.clients),
                "subscriptions": sum(len(t.subscriptions) for t in self.tables.values()),
                "delivered": self.delivered,
                "outbox_peak": max((c.peak for c in self.clients), default=0),
                "closing_slow": sum(c.close_code == SLOW_CLOSE for c in self.clients),
            }


def _decode(table: str, record: Any) -> Change:
    """The change a changelog record (Kafka's) carries; raises on anything else."""
    change = from_record(table, record.key, record.value, list(record.headers or ()))
    rows = (change.row, change.before)
    if not isinstance(change.key, dict) or not all(r is None or isinstance(r, dict) for r in rows):
        raise ValueError("the key, row and before-image must be JSON objects")
    return change


def _xid_of(record: Any) -> int | None:
    """The transaction id a record's `xid` header names, if it can be read."""
    for name, value in record.headers or ():
        if name == "xid":
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None
