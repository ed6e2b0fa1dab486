"""How far each projection (and join) has folded the log: the last applied offset of every
topic-partition, written in the same transaction as its rows; and whether it failed (a transform
that raised: the error, the offsets it could not get past, when) while the others went on; and
the records removed from the log before it could apply them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from projections import metadata

table = Table(
    "projection_progress",
    metadata,
    Column("projection", Text, primary_key=True),
    Column("offsets", JSONB, nullable=False, server_default="{}"),
    Column("events_applied", BigInteger, nullable=False, server_default="0"),
    Column("late_events", BigInteger, nullable=False, server_default="0"),
    Column("generation", BigInteger, nullable=False, server_default="0"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("error", Text),  # set while failed: it is not folded until the pipeline restarts
    Column("error_offsets", JSONB),  # "topic:partition" -> the first offset it could not apply
    Column("failed_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)),  # its pipeline's query last started (warm)
    # Records removed from the log before it applied them (spark/gaps.py): how many offsets in
    # all, and the last few ranges ("partition", "from_offset", "to_offset", "detected_at").
    Column("lost_offsets", BigInteger, nullable=False, server_default="0"),
    Column("data_loss", JSONB),
    # The version its live tables were built by (projections/base/versions.py); the one a
    # projector builds beside them, since when; why its last build failed (guarantee 25).
    Column("version", Text),
    Column("building_version", Text),
    Column("build_error", Text),
    Column("build_started_at", DateTime(timezone=True)),
    # How far that build is (events folded of the log's), and with LOGFOLD_DEPLOY_VERIFY what
    # the new version changes: per table, rows only in the old version and only in the new.
    Column("build_done", BigInteger),
    Column("build_total", BigInteger),
    Column("build_report", JSONB),
)

# Earlier versions of a projection kept for a quick rollback (spark/keeping.py): a copy of
# each of its tables (`tables`: live table -> its copy) at one position of the log (`offsets`),
# with the number of events skipped on purpose then (a later skip makes the copy unusable).
kept_versions = Table(
    "kept_versions",
    metadata,
    Column("projection", Text, primary_key=True),
    Column("version", Text, primary_key=True),
    Column("offsets", JSONB, nullable=False),
    Column("tables", JSONB, nullable=False),
    Column("skipped_events", BigInteger, nullable=False),
    Column("kept_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The projector's own status (spark/status.py), written by its driver every few seconds: its
# Spark master, executors and task slots, the slots its real-time queries need, each query's
# mode. /health reads it (component `projector`).
projector_status = Table(
    "projector_status",
    metadata,
    Column("name", Text, primary_key=True),
    Column("master", Text, nullable=False),
    Column("executors", Integer, nullable=False),
    Column("slots", Integer, nullable=False),
    Column("slots_needed", Integer, nullable=False),
    Column("queries", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("beat_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Rebuilds asked of the running projector (`logfold rebuild`, projections/base/rebuilds.py):
# the projections named and the versions the asking code folds, claimed by a projector that
# folds the same, with its progress, a beat while it works, and each projection's report.
rebuild_requests = Table(
    "rebuild_requests",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("projections", JSONB, nullable=False),  # name -> the version the asking code folds
    Column("verify", Boolean, nullable=False, server_default=text("false")),
    Column("asked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("claimed_by", Text),
    Column("beat_at", DateTime(timezone=True)),
    Column("done", BigInteger),
    Column("total", BigInteger),
    Column("finished_at", DateTime(timezone=True)),
    Column("reports", JSONB),
    Column("error", Text),
)

# Postgres notifies this channel whenever progress rows are written (a trigger, migration
# 0011), once per transaction: readers waiting for a position look again then.
CHANNEL = "logfold_progress"

# The ids of stream records each fold has counted (guarantee 20), kept while a copy of the
# record could still be on time (spark.event_pipeline.keep_ids). A rebuild counts under
# `<fold>__rebuild`, which replaces the fold's own ids at the swap.
stream_ids = Table(
    "stream_ids",
    metadata,
    Column("fold", Text, primary_key=True),
    Column("id", Text, primary_key=True),
    Column("first_at", DateTime(timezone=True), nullable=False),  # log time of its first copy
    Index("ix_stream_ids_first_at", "fold", "first_at"),
)


def _letters(name: str, *extra: Column[Any]) -> Table:
    return Table(
        name,
        metadata,
        Column("projection", Text, primary_key=True),
        Column("topic", Text, primary_key=True),
        Column("partition", Integer, primary_key=True),
        Column("offset", BigInteger, primary_key=True),
        Column("aggregate", Text, nullable=False),  # aggregate id; for a stream, the record's key
        Column("error", Text, nullable=False),  # why it is parked (its own error, or whose)
        Column("parked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        *extra,
        Index(f"ix_{name}_aggregate", "projection", "topic", "aggregate", "partition", "offset"),
    )


# Dead letters (guarantee 26): an event a projection's fold could not apply, and every later
# event of its aggregate, parked in log order while the rest flows (`spark/parking.py`); a retry
# applies them in order and deletes them in the same transaction. `logfold dead-letters`.
parked_events = _letters(
    "parked_events",
    Column("retry_requested_at", DateTime(timezone=True)),
    Column("skip_reason", Text),  # a skip asked for (`/dead-letters`), and why
)
# What was parked and then skipped on purpose: the view leaves exactly these out.
skipped_events = _letters(
    "skipped_events",
    Column("skipped_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("reason", Text, nullable=False),
)
