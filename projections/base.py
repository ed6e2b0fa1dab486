"""What a projection declares, and the SQL that applies its rows to Postgres.

A projection reads some event topics and writes one or more tables (`Output`s). Each output has
a pure Spark `transform(events) -> rows` (see `spark/decode.py` for the events' columns) and a
merge rule per column:

- `latest`: the value of the newest event (by aggregate `version`) that set it; a row from an
  older version never overwrites a newer one;
- `sum`: added to what the table holds;
- key columns identify the row.

The same transform serves the live projector (applied to each micro-batch, then merged with
these rules) and the rebuild (applied to the whole log, then bulk-loaded), so both produce the
same rows. Exactly-once comes from the projection's progress (offsets per topic-partition) being
written in the same transaction as its rows; see `spark/sink.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from sqlalchemy import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

Merge = Literal["latest", "sum"]


@dataclass(frozen=True)
class Output:
    table: Table
    transform: Callable[[DataFrame], DataFrame]
    merge: dict[str, Merge]
    filterable: tuple[str, ...] = ()
    version_column: str | None = "version"
    late: bool = False  # its rows are late events, counted in the projection's progress

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.table.primary_key.columns)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.table.columns)

    def upsert_sql(self, target: str, source: str) -> str:
        """Merge rows from `source` (same columns) into `target` by this output's rules."""
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


@dataclass(frozen=True)
class Projection:
    name: str
    topics: tuple[str, ...]  # aggregate types whose events it reads
    outputs: tuple[Output, ...] = field(default_factory=tuple)
