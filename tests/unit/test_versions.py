"""A projection's version (`projections/base/versions.py`): declared, or derived from what
changes its rows, and nothing else."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import Column, MetaData, Table, Text

from projections import customers
from projections.base import Output, Projection, versions
from projections.registry import PROJECTIONS


def rows_a() -> Any:
    """A docstring."""
    return customers.rows()


def rows_a_commented() -> Any:
    """Another docstring, and a comment below: neither changes the rows."""
    # the same rows
    return customers.rows()


def rows_b() -> Any:
    return customers.rows().alias("changed")


def with_rows(rows: Any, table: Table = customers.table, **fields: Any) -> Projection:
    output = Output(table, rows=rows, merge=customers.output.merge)
    return Projection("customers", topics=("customer",), outputs=(output,), **fields)


def test_every_projection_has_a_version_that_is_the_same_each_time() -> None:
    found = {name: versions.of(p) for name, p in PROJECTIONS.items()}
    assert found == {name: versions.of(p) for name, p in PROJECTIONS.items()}
    assert len(set(found.values())) == len(found)  # (their names differ, at least)


def test_a_changed_rows_function_is_another_version_and_a_docstring_or_comment_is_not() -> None:
    assert versions.of(with_rows(rows_a)) != versions.of(with_rows(rows_b))
    # Their names differ (a renamed function is another version); their bodies do not.
    assert versions._code(rows_a).replace("rows_a", "f") == versions._code(
        rows_a_commented
    ).replace("rows_a_commented", "f")


def test_a_changed_table_or_rule_is_another_version() -> None:
    base = with_rows(rows_a)
    wider = Table(
        "customers",
        MetaData(),
        *(Column(c.name, c.type, primary_key=c.primary_key) for c in customers.table.columns),
        Column("nickname", Text),
    )
    assert versions.of(with_rows(rows_a, wider)) != versions.of(base)
    output = dataclasses.replace(base.outputs[0], merge={"name": "latest"})
    assert versions.of(dataclasses.replace(base, outputs=(output,))) != versions.of(base)
    assert versions.of(dataclasses.replace(base, topics=("customer", "order"))) != versions.of(base)


def test_a_declared_version_is_the_version() -> None:
    assert versions.of(with_rows(rows_b, version="7")) == "7"
