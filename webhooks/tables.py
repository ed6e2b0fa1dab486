"""The webhooks' tables: endpoints (each with its durable cursor) and their dead letters.

The cursor lives in Postgres, beside the endpoint it belongs to, not in a Kafka consumer
group: the API pauses, resumes and deletes endpoints there, a dead letter and the cursor that
moves past it are written in one transaction, and a worker's advisory lock on its endpoint
(held by the same session that moves the cursor) keeps a second dispatcher from delivering it
at once (docs/webhooks.md)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from projections import metadata

endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("id", Text, primary_key=True),
    Column("url", Text, nullable=False),
    Column("view", Text, nullable=False),
    Column("filter", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("secret", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="active"),
    Column("paused_reason", Text),
    # The next offset of the view's changelog (`cdc.<view>`) to look at, and the WAL position
    # of the last change looked at (a change CDC sends again after a crash is not delivered
    # twice).
    Column("cursor", BigInteger, nullable=False),
    Column("last_position", Text),
    # Since when the endpoint has failed without a success in between (it is paused after
    # `LOGFOLD_WEBHOOK_PAUSE_AFTER_S`), and the delivery being retried: its offset, the time
    # of its first failed attempt (its retry window's start), its attempts, the last error.
    Column("failing_since", DateTime(timezone=True)),
    Column("retrying_offset", BigInteger),
    Column("retrying_since", DateTime(timezone=True)),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", Text),
    # Changelog offsets compaction removed before the endpoint's cursor reached them.
    Column("skipped_offsets", BigInteger, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("status IN ('active', 'paused')", name="ck_webhook_endpoints_status"),
)

dead_letters = Table(
    "webhook_dead_letters",
    metadata,
    Column("message_id", Text, primary_key=True),
    Column(
        "endpoint_id",
        Text,
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("offset", BigInteger, nullable=False),
    Column("position", Text, nullable=False),
    Column("key", JSONB, nullable=False),
    Column("body", Text, nullable=False),  # exactly what was signed and sent
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text, nullable=False),
    Column("first_attempt_at", DateTime(timezone=True), nullable=False),
    Column("failed_at", DateTime(timezone=True), nullable=False),
    # failed, then `replaying` once a replay is asked for, then `delivered` (or failed again)
    Column("status", Text, nullable=False, server_default="failed"),
    Column("replayed_at", DateTime(timezone=True)),
    CheckConstraint(
        "status IN ('failed', 'replaying', 'delivered')", name="ck_webhook_dead_letters_status"
    ),
    Index("ix_webhook_dead_letters_endpoint", "endpoint_id", "status", "offset"),
)
