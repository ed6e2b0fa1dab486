"""A reference webhook receiver: pays each royalty payout exactly once.

Logfold delivers every change of the `royalty_payouts` view at least once, each under a stable
`webhook-id` (docs/webhooks.md). This receiver turns that into an exactly-once effect:

1. It verifies the Standard Webhooks signature (the `standardwebhooks` library), else `401`.
2. It writes the delivery to its inbox, durably (SQLite, `synchronous=FULL`), before anything
   else: receiver-based message logging. A delivery it has logged is never lost, even if it
   crashes before answering; one it has not logged was not acknowledged, so it comes again.
3. It pays: the payment in its ledger and the inbox entry marked processed in ONE transaction.
   A delivery whose id is already processed pays nothing; neither does a payout (order, book)
   already paid under another delivery (a later change of the same row).
4. Only then it answers `204`. On start it first pays what its inbox holds unprocessed.

Run it (the secret is the endpoint's, as `POST /webhooks` returned or was given it):

    python examples/royalty_receiver.py --port 9000 --db payouts.sqlite \\
        --secret whsec_...            # or ROYALTY_RECEIVER_SECRET
    curl -X POST http://127.0.0.1:8000/webhooks -H "Authorization: Bearer $TOKEN" \\
        -H 'Content-Type: application/json' \\
        -d '{"url": "http://127.0.0.1:9000/", "view": "royalty_payouts", "secret": "whsec_..."}'

(a receiver on 127.0.0.1 needs `LOGFOLD_WEBHOOK_ALLOW_PRIVATE=true` for `logfold webhooks`).

For crash tests, ROYALTY_RECEIVER_CRASH=<point>:<n> kills the process with SIGKILL at the n-th
delivery it handles, at one of the points `after-receipt` (before logging), `after-log`
(logged, not paid), `after-pay` (paid, not acknowledged).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sqlite3
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from standardwebhooks import Webhook, WebhookVerificationError

log = logging.getLogger("royalty-receiver")

SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (
    message_id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    processed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS payments (
    payment_id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL,
    book_id TEXT NOT NULL,
    author TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    paid_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS payments_by_payout ON payments (order_id, book_id);
"""
MAX_BODY_BYTES = 1024 * 1024


class Ledger:
    """The receiver's durable state: its inbox and the payments made."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        self.db.executescript(SCHEMA)

    def log(self, message_id: str, body: str) -> None:
        """Keep the delivery (once; a redelivery changes nothing)."""
        self.db.execute(
            "INSERT INTO inbox (message_id, body) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (message_id, body),
        )

    def process(self, message_id: str) -> None:
        """Apply one logged delivery, at most once: the payment and the mark in one transaction."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute(
                "SELECT body, processed FROM inbox WHERE message_id = ?", (message_id,)
            ).fetchone()
            if row is not None and not row[1]:
                self._pay(message_id, json.loads(row[0]))
                self.db.execute(
                    "UPDATE inbox SET processed = 1 WHERE message_id = ?", (message_id,)
                )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _pay(self, message_id: str, change: dict[str, Any]) -> None:
        if change.get("view") != "royalty_payouts" or change.get("op") != "upsert":
            return  # a payout leaving the view is not a refund here
        row = change["row"]
        paid = self.db.execute(
            "SELECT 1 FROM payments WHERE order_id = ? AND book_id = ?",
            (row["order_id"], row["book_id"]),
        ).fetchone()
        if paid is None:  # a later change of a paid payout (its account, say) pays nothing
            self.db.execute(
                "INSERT INTO payments (order_id, book_id, author, amount_cents, message_id) "
                "VALUES (?, ?, ?, ?, ?)",
                (row["order_id"], row["book_id"], row["author"], row["amount_cents"], message_id),
            )

    def recover(self) -> int:
        """Process what was logged before a crash and not processed; how many."""
        pending = [
            r[0]
            for r in self.db.execute(
                "SELECT message_id FROM inbox WHERE processed = 0 ORDER BY rowid"
            ).fetchall()
        ]
        for message_id in pending:
            self.process(message_id)
        return len(pending)


class Crash:
    """ROYALTY_RECEIVER_CRASH=<point>:<n>: SIGKILL at `point` of the n-th delivery."""

    POINTS = ("after-receipt", "after-log", "after-pay")

    def __init__(self, spec: str | None) -> None:
        self.point, self.at, self.seen = None, 0, 0
        if spec:
            point, _, n = spec.partition(":")
            if point not in self.POINTS or not n.isdigit():
                raise SystemExit(f"ROYALTY_RECEIVER_CRASH: <{'|'.join(self.POINTS)}>:<n>")
            self.point, self.at = point, int(n)

    def delivery(self) -> None:
        self.seen += 1

    def maybe(self, point: str) -> None:
        if point == self.point and self.seen == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def handler(ledger: Ledger, hook: Webhook, crash: Crash) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                return self._answer(413)
            body = self.rfile.read(length)
            try:
                hook.verify(body, {k: v for k, v in self.headers.items()})
            except WebhookVerificationError:
                return self._answer(401)
            crash.delivery()
            message_id = self.headers["webhook-id"]
            crash.maybe("after-receipt")
            ledger.log(message_id, body.decode())
            crash.maybe("after-log")
            ledger.process(message_id)
            crash.maybe("after-pay")
            self._answer(204)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Receive royalty_payouts changes from Logfold webhooks and pay each payout "
        "exactly once (a durable inbox and ledger in SQLite).",
        epilog="ROYALTY_RECEIVER_CRASH=<after-receipt|after-log|after-pay>:<n> kills the "
        "process (SIGKILL) at that point of the n-th delivery, for crash tests.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    parser.add_argument("--db", default="royalties.sqlite", help="the inbox and ledger file")
    parser.add_argument(
        "--secret",
        default=os.environ.get("ROYALTY_RECEIVER_SECRET"),
        help="the endpoint's whsec_… secret (default: ROYALTY_RECEIVER_SECRET)",
    )
    args = parser.parse_args(argv)
    if not args.secret:
        parser.error("give --secret or ROYALTY_RECEIVER_SECRET")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ledger = Ledger(args.db)
    recovered = ledger.recover()
    crash = Crash(os.environ.get("ROYALTY_RECEIVER_CRASH"))
    server = HTTPServer((args.host, args.port), handler(ledger, Webhook(args.secret), crash))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info(
        "receiving on http://%s:%d/ (recovered %d logged deliveries)",
        args.host,
        args.port,
        recovered,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
