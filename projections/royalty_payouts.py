"""Royalty payouts: each paid order line, with the payout account of its author *as the profile
was when the payment happened* (a temporal stream-table join of `OrderPaid` with
`author_profiles`).

The account comes from `author_profile_history` (every version of each profile, kept by a
trigger; see author_profiles): the version valid at the payment's event time. A later change
of the profile does not rewrite past payouts, and a rebuild finds the same versions. A payment
for an author with no profile then gets no account (`payout_account` null), counted in
/health and /metrics as `payouts_without_account`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, DateTime, Index, Table, Text, text
from sqlalchemy import Column as SqlColumn

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from projections.base.rows import Rows

table = Table(
    "royalty_payouts",
    metadata,
    SqlColumn("order_id", Text, primary_key=True),
    SqlColumn("book_id", Text, primary_key=True),
    SqlColumn("author", Text, nullable=False),
    SqlColumn("payout_account", Text),
    SqlColumn("amount_cents", BigInteger, nullable=False),
    SqlColumn("paid_at", DateTime(timezone=True), nullable=False),
    # /health counts the payouts without an account: kept small by indexing only those.
    Index(
        "ix_royalty_payouts_without_account",
        "author",
        postgresql_where=text("payout_account IS NULL"),
    ),
)


def rows() -> Rows:
    """A payment: per line, the author's royalty on it (the account is looked up in Postgres)."""
    from projections.author_royalties import royalty_column
    from projections.base.rows import F, each_paid_line

    return each_paid_line(
        table,
        lambda line: {
            "order_id": F.col("aggregate_id"),
            "book_id": line["book_id"],
            "author": line["author"],
            "amount_cents": royalty_column(
                line["quantity"], line["unit_price_cents"], line["royalty_rate"]
            ),
            "paid_at": F.col("occurred_at"),
        },
    )


@dataclass(frozen=True, kw_only=True)
class AsOf(Output):
    """Rows merged with the payout account of the profile version valid at `paid_at`: looked
    up per batch by the live merge, and once over the whole table after a rebuild's bulk load
    (whose fold leaves the account null)."""

    def merge_sql(self, target: str, rows: str) -> str:
        return f"""
INSERT INTO {target} (order_id, book_id, author, payout_account, amount_cents, paid_at)
SELECT r.order_id, r.book_id, r.author, {_account("r")}, sum(r.amount_cents), r.paid_at
FROM json_populate_recordset(NULL::{self.name}, {rows}::json) r
GROUP BY r.order_id, r.book_id, r.author, r.paid_at
ON CONFLICT (order_id, book_id) DO NOTHING"""

    def load_statements(self, target: str) -> list[str]:
        # Only the rows whose author had a profile by then are written twice.
        return [
            f"UPDATE {target} r SET payout_account = {_account('r')} WHERE EXISTS ("
            "SELECT 1 FROM author_profile_history h "
            "WHERE h.author = r.author AND h.valid_from <= r.paid_at)"
        ]


def _account(row: str) -> str:
    """The payout account of `row`'s author as the profile was at `row`'s `paid_at`."""
    return f"""(
    SELECT h.payout_account FROM author_profile_history h
    WHERE h.author = {row}.author AND h.valid_from <= {row}.paid_at
    ORDER BY h.valid_from DESC LIMIT 1
)"""


payouts = AsOf(
    table,
    rows=rows,
    merge={"amount_cents": "sum"},  # of an order's lines of one book (one payment per order)
    filterable=("author", "order_id"),
    version_column=None,
    counted={"payouts_without_account": "payout_account IS NULL"},
)
projection = Projection("royalty_payouts", topics=("order",), outputs=(payouts,))
