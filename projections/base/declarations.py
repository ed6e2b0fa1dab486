"""What the read side folds, declared without Spark: projections (events -> views) and joins
(changelogs -> a joined view), and the SQL that applies their rows to Postgres.

Both are `Fold`s: each reads some partitions of the log, keeps its own progress (the last
applied offset of each partition, in `projection_progress`, written in the same transaction as
its rows) and writes views. The Spark side (`spark/`) runs every fold of a kind in one pipeline.

A `Projection` reads event topics and writes one or more tables (`Output`s). Each output says
what rows one event adds to it (a Spark column over the event: `spark/decode.py` has the
event's columns) and how rows with the same key combine, per column:

- `latest`: the value of the newest event (by aggregate `version`) that set it; a row from an
  older version never overwrites a newer one;
- `sum`: added to what the table holds;
- key columns identify the row.

The live pipeline computes each event's rows once as it reads the log and combines a batch's
rows with the table in Postgres; a rebuild combines the whole log's rows in Spark. Both apply
these rules, so both produce the same table. Row expressions import pyspark inside their body:
the API, CDC and migrations import the declarations and never load Spark.

A `Join` declares a view that is the inner join of two captured tables, folded from their CDC
changelogs rather than from events (see `spark/join.py`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from config.topics import Topics

Merge = Literal["latest", "sum"]
Offsets = dict[str, int]  # "topic:partition" -> last applied offset
_POSTGRES = postgresql.dialect()  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class View:
    """A table the API serves: its key, columns and the columns it can be filtered on."""

    table: Table
    filterable: tuple[str, ...] = ()
    # Rows worth a figure in /health and /metrics: name -> SQL condition on the view's rows.
    counted: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.table.name)  # a plain str: Spark refuses str subclasses as names

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(c.name) for c in self.table.primary_key.columns)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(str(c.name) for c in self.table.columns)


@dataclass(frozen=True, kw_only=True)
class Output(View):
    """A view a projection writes: the rows each event adds to it, and how rows combine.

    `rows()` gives the rows one event adds (over the columns of `spark/decode.py`), each a
    struct of the table's columns: built in parts by `projections/base/rows.py` (`one`, `each`,
    `each_paid_line`: a `Rows`), or any Spark column of an array of them. Rows with the same
    key combine by `merge`: `latest` takes the value of the newest row (by `version_column`)
    that sets it, `sum` adds; any other column keeps the first row's value. The live pipeline
    combines a batch's rows in Postgres (`combine_sql`, then `upsert_sql` into the table); a
    rebuild combines the whole log's in Spark (`projections.base.rows.fold`). Both follow these
    rules, so both give the same table."""

    rows: Callable[[], Any]  # () -> `projections.base.rows.Rows`, or a pyspark Column of an array
    merge: dict[str, Merge]
    version_column: str | None = "version"
    late: bool = False  # its rows are late events, counted in the projection's progress
    # Tables it keeps for itself (not served): a rebuild fills their shadows with the output's.
    state: tuple[Table, ...] = ()
    # Its personal columns (guarantee 27): column -> the aggregate type of its data subject and
    # the column holding the subject's id. They hold an event's personal field as it came,
    # sealed; it is opened as the rows enter Postgres (events/keys.py), `[erased]` once the
    # subject's key is gone. A fold copies such a field, never computes on it.
    personal: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = [
            f"{c} is not a column"
            for c in (*self.merge, *self.personal, *(i for _, i in self.personal.values()))
            if c not in self.columns
        ]
        if self.version_column is None and "latest" in self.merge.values():
            problems.append("`latest` columns need a version column")
        elif self.version_column is not None and self.version_column not in self.columns:
            problems.append(f"no version column {self.version_column}")
        if problems:
            raise ValueError(f"output {self.name}: " + "; ".join(problems))

    def rule(self, column: str) -> str:
        """How `column` combines: key, version, latest, sum or first."""
        if column in self.key:
            return "key"
        if column == self.version_column:
            return "version"
        return self.merge.get(column, "first")

    @property
    def replayed(self) -> bool:
        """Whether a rebuild must replay the log through `merge_sql` (the rows of this output
        combine only in Postgres) instead of folding it in Spark (`projections.base.rows.fold`)."""
        return False

    def load_statements(self, target: str) -> list[str]:
        """The statements a rebuild runs once after bulk-loading the rows that
        `projections.base.rows.fold` builds into `target` (this table's shadow): what `merge_sql`
        does to each batch's rows in Postgres and the fold in Spark cannot. None by default."""
        return []

    def merge_statements(self, suffix: str, rows: str) -> list[str]:
        """The statements that merge a batch's rows (`rows`: the name of a JSON array
        parameter) into this table and its state tables, each name + `suffix` (a rebuild's
        shadows), run in order in one transaction. A statement that does not name `rows`
        runs without it (it reads what an earlier one staged)."""
        return [self.merge_sql(self.name + suffix, rows)]

    @property
    def staged(self) -> str | None:
        """If its merge first stages a batch's rows in a table of their own (then reads them
        from there), that table's columns (SQL: `name type, …`, the fields of `rows()`);
        `merge_staged_statements` merges rows staged in any table of these columns. A rebuild
        then COPYs the whole log's rows into one instead of handing them over as JSON. Such a
        merge must give the same table whatever order a batch's rows are merged in, in parts.
        None by default."""
        return None

    def merge_staged_statements(self, suffix: str, staged: str, empty: bool = False) -> list[str]:
        """The statements that merge the rows staged in table `staged` (see `staged`) into
        this table and its state tables, each name + `suffix`, in one transaction.

        `empty`: those tables are empty and have no keys while these run (a rebuild's first
        merge, the keys built after it): the statements must not look keys up (no
        `ON CONFLICT`) and must leave no key twice."""
        raise NotImplementedError(f"output {self.name} stages no rows")

    def prune_statements(self, suffix: str) -> list[str]:
        """The statements that drop the state nothing on time can need any more, run once
        after all of a batch's rows are merged (a large batch is merged in several runs of
        `merge_statements`, in log order per partition, not in time order across them)."""
        return []

    def whole_log_rows(self, staged: DataFrame, records: DataFrame) -> DataFrame:
        """Of the rows a rebuild stages from the whole log (`staged`, a Spark DataFrame of the
        events on time, merged at once into empty tables by `merge_staged_statements`), those
        that can change the tables left after `prune_statements`; `records` holds every record
        the rebuild reads (events and stream records, on time or late, with the columns of
        `spark/decode.py`). A rebuild then copies only those. All of them by default."""
        return staged

    def merge_sql(self, target: str, rows: str) -> str:
        """Merge a batch's rows (`rows`: the name of a JSON array parameter, one object per
        row, any number per key) into `target` (this table or its shadow)."""
        # `json`, not `jsonb`: read once, as text, it is expanded faster (no binary form to build).
        source = f"json_populate_recordset(NULL::{self.name}, {rows}::json) WITH ORDINALITY AS r"
        return self.upsert_sql(target, f"({self.combine_sql(source)}) AS batch")

    def combine_sql(self, source: str) -> str:
        """SELECT of one row per key from `source`, a set of rows of this table with an
        `ordinality` column (their order in the batch), combined by the merge rules."""
        vc = self.version_column
        cols = []
        for column in self.table.columns:
            c, rule = str(column.name), self.rule(str(column.name))
            if rule == "key":
                cols.append(c)
            elif rule == "version":
                cols.append(f"max({c}) AS {c}")
            elif rule == "sum":
                kind = column.type.compile(dialect=_POSTGRES)
                cols.append(f"CAST(coalesce(sum({c}), 0) AS {kind}) AS {c}")
            elif rule == "latest":
                cols.append(
                    f"(array_agg({c} ORDER BY {vc} DESC NULLS LAST, ordinality DESC) "
                    f"FILTER (WHERE {c} IS NOT NULL))[1] AS {c}"
                )
            else:
                cols.append(f"(array_agg({c} ORDER BY ordinality))[1] AS {c}")
        return f"SELECT {', '.join(cols)} FROM {source} GROUP BY {', '.join(self.key)}"

    def upsert_sql(self, target: str, source: str) -> str:
        """Merge rows from `source` (same columns, one per key) into `target` by this output's
        rules."""
        cols = ", ".join(self.columns)
        keys = ", ".join(self.key)
        sets = []
        vc = self.version_column
        newer = f"excluded.{vc} > {target}.{vc} OR {target}.{vc} IS NULL" if vc else "TRUE"
        for col, rule in self.merge.items():
            if rule == "sum":
                sets.append(f"{col} = {target}.{col} + excluded.{col}")
            else:
                sets.append(
                    f"{col} = CASE WHEN excluded.{col} IS NOT NULL AND ({newer}) "
                    f"THEN excluded.{col} ELSE {target}.{col} END"
                )
        if vc:
            sets.append(f"{vc} = GREATEST({target}.{vc}, excluded.{vc})")
        action = f"DO UPDATE SET {', '.join(sets)}" if sets else "DO NOTHING"
        return (
            f"INSERT INTO {target} ({cols}) SELECT {cols} FROM {source} "
            f"ON CONFLICT ({keys}) {action}"
        )


class Fold(ABC):
    """Something the read side folds into views from partitions of the log, with its own
    progress (the `projection_progress` row named after it): a projection or a join."""

    name: str  # also the name of its progress row
    transactional: ClassVar[bool]  # its partitions hold transaction markers (they take offsets)

    @property
    @abstractmethod
    def views(self) -> tuple[View, ...]:
        """The tables it writes."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The captured tables it reads through their changelogs (none: it reads events)."""
        return ()

    @abstractmethod
    def reads(self, topics: Topics, partitions: int) -> list[str]:
        """The partitions it folds, as its progress names them ("topic:partition")."""

    def behind(self, applied: Offsets, ends: Offsets, topics: Topics, partitions: int) -> int:
        """Records of its partitions after `applied`, given their `ends` (next offsets).
        Offsets count transaction markers too, so while behind this is an upper bound; caught
        up, it is exactly 0 (the marker after the last applied record is not counted)."""
        total = 0
        for k in self.reads(topics, partitions):
            last = int(applied.get(k, -1))
            marker = 1 if self.transactional and last >= 0 else 0
            total += max(ends.get(k, 0) - last - 1 - marker, 0)
        return total


@dataclass(frozen=True)
class Projection(Fold):
    """Folds the events of some aggregate types (`topics`) and the records of some streams of
    facts (`streams`) into its outputs.

    A projection that reads streams declares its watermark, `lateness`: a record (or event) is
    late when its event time (`occurred_at`) is more than `lateness` older than the time its
    record reached the log (when the API received it). Late records are counted in the
    projection's `late_events` and left out of its outputs. Both times are in the log, so
    lateness does not depend on when or in which batches the log is read: the live views and a
    rebuild agree. A stream record's `id` is counted once (guarantee 20): a record whose id the
    projection has already counted (in `stream_ids`, for as long as a copy could still be on
    time) is left out as a retry."""

    name: str
    topics: tuple[str, ...]  # aggregate types whose events it reads
    outputs: tuple[Output, ...] = field(default_factory=tuple)
    streams: tuple[str, ...] = ()  # streams of facts whose records it reads
    lateness: timedelta | None = None  # its watermark (required with streams)
    # What its live tables are built by: declared here, or derived (projections/base/versions.py)
    version: str | None = None
    transactional: ClassVar[bool] = True  # the command processors and ingestion use transactions

    def __post_init__(self) -> None:
        if self.streams and self.lateness is None:
            raise ValueError(f"projection {self.name} reads streams: declare its `lateness`")

    @property
    def views(self) -> tuple[View, ...]:
        return self.outputs

    @property
    def replayed(self) -> bool:
        """Rebuilt by replaying its log through the live pipeline's merge (into shadows), not
        by a fold in Spark: it counts ids or has outputs that combine only in Postgres."""
        return bool(self.streams) or any(o.replayed for o in self.outputs)

    def topic_names(self, topics: Topics) -> list[str]:
        """The Kafka topics it reads."""
        return [topics.events(t) for t in self.topics] + [topics.stream(s) for s in self.streams]

    def reads(self, topics: Topics, partitions: int) -> list[str]:
        return [f"{t}:{p}" for t in self.topic_names(topics) for p in range(partitions)]


Role = Literal["left", "right"]
ROLES: tuple[Role, Role] = ("left", "right")
JOIN_STATE = "join_state"  # projections/base/join_state.py
_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass(frozen=True)
class Side:
    """One input of a join: a captured table (read from its changelog `cdc.<table>`), its
    primary key columns, and its join column."""

    table: str
    key: tuple[str, ...]
    on: str


@dataclass(frozen=True)
class Join(Fold):
    """A view that is the inner join of two captured tables, kept current from their changelogs.

    A joined row exists iff a row of each side exists with equal join columns (NULL matches
    nothing). Each view column comes from one side's column (`sources`: view column -> (role,
    source column)). A change on either side re-derives the joined rows of that side row, with
    its old and its new join value; a delete on either side deletes them. The view's key must
    identify a pair of side rows: it covers both sides' keys, or one side's key when the other
    is keyed by its join column (then at most one of its rows matches).

    The live job (`spark/join.py`) keeps each side's last row per key, with its changelog
    position, in `join_state`; the view is always the join of that state (`derive_sql`), and
    only rows that differ are written, so the view's own changelog carries minimal changes.
    Its progress (offsets of the two changelogs) is the `projection_progress` row `name`."""

    table: Table
    left: Side
    right: Side
    sources: dict[str, tuple[Role, str]]
    filterable: tuple[str, ...] = ()
    transactional: ClassVar[bool] = False  # CDC writes changelogs without transactions

    def __post_init__(self) -> None:
        columns = set(self.columns)
        problems = [f"no source for column {c}" for c in self.columns if c not in self.sources]
        problems += [
            f"{c} is not a column of {self.name}" for c in self.sources if c not in columns
        ]
        problems += [f"filterable {c} is not a column" for c in self.filterable if c not in columns]
        names = [self.name, *self.columns]
        for side in (self.left, self.right):
            names += [side.table, side.on, *side.key]
        names += [src for _, src in self.sources.values()]
        problems += [
            f"{n!r} is not a plain lower-case SQL name" for n in names if not _NAME.fullmatch(n)
        ]
        problems += [f"unknown side {r!r}" for r, _ in self.sources.values() if r not in ROLES]
        if not problems and not self._pairs_are_unique():
            problems.append(f"the key {self.key} does not identify a pair of joined rows")
        if problems:
            raise ValueError(f"join {self.name}: " + "; ".join(problems))

    def _pairs_are_unique(self) -> bool:
        covered = {self.sources[c] for c in self.key}

        def covers(role: Role) -> bool:
            return all((role, k) in covered for k in self.side(role).key)

        def keyed_by_join_column(role: Role) -> bool:
            return self.side(role).key == (self.side(role).on,)

        return (covers("left") and (covers("right") or keyed_by_join_column("right"))) or (
            covers("right") and keyed_by_join_column("left")
        )

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.table.name)  # a plain str: Spark refuses str subclasses as query names

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(c.name) for c in self.table.primary_key.columns)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(str(c.name) for c in self.table.columns)

    @property
    def tables(self) -> tuple[str, ...]:
        """The captured tables it reads (one for a self-join)."""
        return tuple(dict.fromkeys((self.left.table, self.right.table)))

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.tables

    @property
    def views(self) -> tuple[View, ...]:
        return (View(self.table, self.filterable),)

    def reads(self, topics: Topics, partitions: int) -> list[str]:
        return [f"{topics.cdc(t)}:0" for t in self.tables]  # a changelog has one partition

    def side(self, role: Role) -> Side:
        return self.left if role == "left" else self.right

    # -- SQL over join_state (names are checked above, so they are safe to inline) ----------

    def join_value_sql(self, alias: str) -> str:
        """The join value of a state or change row `alias` (with `side` and `row` columns)."""
        return (
            f"CASE {alias}.side WHEN 'left' THEN {alias}.row ->> '{self.left.on}' "
            f"ELSE {alias}.row ->> '{self.right.on}' END"
        )

    def derive_sql(self, changes: str) -> str:
        """SELECT of the view's rows that a batch of `changes` (a relation with `side` and
        `key` columns) can alter, derived from the join's state: the pairs of a changed left
        or right row, each once (any other row comes from side rows the batch did not touch).
        Before the batch is stored it gives the pairs as they were; after, as they are."""
        cols = []
        for column in self.table.columns:
            role, src = self.sources[column.name]
            kind = column.type.compile(dialect=_POSTGRES)
            cols.append(f"CAST({role[0]}.row ->> '{src}' AS {kind}) AS {column.name}")
        pairs = (
            f"SELECT {', '.join(cols)} FROM {JOIN_STATE} l JOIN {JOIN_STATE} r "
            f"ON r.join_name = l.join_name AND r.side = 'right' AND r.join_value = l.join_value "
            f"WHERE l.join_name = '{self.name}' AND l.side = 'left' "
        )

        def changed(role: Role, alias: str) -> str:
            return (
                f"EXISTS (SELECT 1 FROM {changes} c "
                f"WHERE c.side = '{role}' AND c.key = {alias}.key)"
            )

        # Two branches, each led by its side's key (the state's primary key), rather than one
        # OR, which Postgres can only answer by scanning the join's whole state.
        return (
            f"{pairs}AND {changed('left', 'l')} "
            f"UNION ALL {pairs}AND {changed('right', 'r')} AND NOT {changed('left', 'l')}"
        )

    def state_upsert_sql(self, changes: str) -> str:
        """Store each change unless the state already holds a newer (or the same) position:
        a change CDC resends after a restart never moves a key back; a delete is kept as a
        row without `row`, so a resent older insert cannot bring the key back."""
        return (
            f"INSERT INTO {JOIN_STATE} (join_name, side, key, join_value, row, lsn, seq) "
            f"SELECT '{self.name}', side, key, join_value, row, lsn, seq FROM {changes} "
            f"ON CONFLICT (join_name, side, key) DO UPDATE SET join_value = excluded.join_value, "
            f"row = excluded.row, lsn = excluded.lsn, seq = excluded.seq "
            f"WHERE (excluded.lsn, excluded.seq) > ({JOIN_STATE}.lsn, {JOIN_STATE}.seq)"
        )

    def upsert_sql(self, rows: str) -> str:
        """Write the rows of `rows` that are new or differ from the view's (only those)."""
        cols, keys = ", ".join(self.columns), ", ".join(self.key)
        values = [c for c in self.columns if c not in self.key]
        if not values:
            action = "DO NOTHING"
        else:
            sets = ", ".join(f"{c} = excluded.{c}" for c in values)
            old = ", ".join(f"{self.name}.{c}" for c in values)
            new = ", ".join(f"excluded.{c}" for c in values)
            action = f"DO UPDATE SET {sets} WHERE ROW({old}) IS DISTINCT FROM ROW({new})"
        return (
            f"INSERT INTO {self.name} ({cols}) SELECT {cols} FROM {rows} "
            f"ON CONFLICT ({keys}) {action}"
        )

    def delete_sql(self, before: str, after: str) -> str:
        """Delete the view's rows whose key is in `before` but no longer in `after`."""
        keys = ", ".join(self.key)
        match = " AND ".join(f"t.{k} = gone.{k}" for k in self.key)
        return (
            f"DELETE FROM {self.name} t USING "
            f"(SELECT {keys} FROM {before} EXCEPT SELECT {keys} FROM {after}) gone WHERE {match}"
        )
