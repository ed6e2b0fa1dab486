"""An erasure reaches the copies of a view's rows outside the view (guarantee 27).

When a batch erases a subject's personal fields in a view (its rows come with `ERASED`: the
subject's key is gone, events/keys.py), the view's own rows change in the batch's transaction,
and CDC carries the change on to changelogs, joined views and subscribers. Two copies do not
follow a view's changes, and are erased here, in the same transaction:

- the earlier versions of the projection kept for a rollback (spark/keeping.py): their rows of
  the subject get `ERASED` in the same columns;
- the webhook deliveries kept as dead letters: their bodies are the changes as they were sent,
  clear values included; each clear value the view held for the subject (read before the
  batch's merge) is replaced there by `ERASED`. A replay then sends the erased body."""

from __future__ import annotations

import json
from typing import Any

import orjson
import psycopg

from events.base import ERASED
from events.keys import is_sealed
from projections.base import Output


def erased_subjects(output: Output, rows: list[dict[str, Any]]) -> list[str]:
    """The ids of the subjects whose personal fields `rows` erase."""
    return sorted(
        {
            str(row[id_column])
            for row in rows
            for column, (_, id_column) in output.personal.items()
            if row.get(column) == ERASED and row.get(id_column) is not None
        }
    )


def clear_values(conn: psycopg.Connection[Any], output: Output, subjects: list[str]) -> set[str]:
    """The values `output`'s table holds in the personal columns of `subjects`' rows."""
    found: set[str] = set()
    for column, (_, id_column) in output.personal.items():
        rows = conn.execute(
            f"SELECT {column} FROM {output.name} WHERE {id_column} = ANY(%s)", (subjects,)
        ).fetchall()
        found |= {str(r[0]) for r in rows if r[0] is not None}
    return {v for v in found if v != ERASED and not is_sealed(v)}


def erase_copies(
    conn: psycopg.Connection[Any], output: Output, subjects: list[str], clear: set[str]
) -> None:
    """Erase `subjects` in the kept copies of `output`'s table and `clear` in the webhooks'
    dead letters."""
    kept = conn.execute(
        "SELECT tables ->> %s FROM kept_versions WHERE tables ? %s", (output.name, output.name)
    ).fetchall()
    for (copy,) in kept:
        for column, (_, id_column) in output.personal.items():
            conn.execute(
                f"UPDATE {copy} SET {column} = %s WHERE {id_column} = ANY(%s)", (ERASED, subjects)
            )
    erased_json = json.dumps(ERASED)
    for value in clear:
        # As the body's JSON has it: with non-ASCII characters as they are, or escaped.
        for written in {orjson.dumps(value).decode(), json.dumps(value)}:
            conn.execute(
                "UPDATE webhook_dead_letters SET body = replace(body, %s, %s) "
                "WHERE strpos(body, %s) > 0",
                (written, erased_json, written),
            )
