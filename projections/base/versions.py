"""A projection's version: what its live tables were built by (guarantee 25).

Declared (`Projection.version`), or derived from what changes its rows: its name, the topics
and streams it reads and its watermark; and per output its table (columns, types, keys), its
merge rules, and the code of its `rows` function and, for an output of its own class (one that
merges in SQL of its own), of that class. Code is compared by its syntax tree without
docstrings, so a comment, a docstring or formatting changes nothing. A change somewhere
else that changes rows (a helper of `projections/base/rows.py` a view uses) changes no derived
version: declare one then (`Projection(..., version="2")`)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import threading
from typing import Any

from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateTable

from projections.base.declarations import Join, Output, Projection

_POSTGRES = postgresql.dialect()  # type: ignore[no-untyped-call]
LENGTH = 12  # hex digits of a derived version


def of(p: Projection) -> str:
    """`p`'s version: its declared one, or the one derived from what changes its rows."""
    if p.version is not None:
        return p.version
    digest = hashlib.sha256()
    for part in _parts(p):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:LENGTH]


def of_join(j: Join) -> str:
    """`j`'s definition, digested as a projection's version is: its table, sides and sources.
    (A join has no version of its own: its view is the join of its sides' current rows.)"""
    parts = [
        j.name,
        str(CreateTable(j.table).compile(dialect=_POSTGRES)),
        repr((j.left, j.right, sorted(j.sources.items()), j.filterable)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:LENGTH]


def _parts(p: Projection) -> list[str]:
    parts = [p.name, repr(p.topics), repr(p.streams), repr(p.lateness)]
    for o in p.outputs:
        parts += [
            str(CreateTable(o.table).compile(dialect=_POSTGRES)),
            repr(sorted(o.merge.items())),
            repr((o.version_column, o.late, o.filterable)),
            *(str(CreateTable(t).compile(dialect=_POSTGRES)) for t in o.state),
            _code(o.rows),
        ]
        if type(o) is not Output:
            parts.append(_code(type(o)))
    return parts


# CPython 3.11's ast module counts the depth of the tree it builds in state every thread
# shares: two threads parsing at once can fail with "SystemError: AST constructor recursion
# depth mismatch" (seen once: a rebuild and a live pipeline working out versions at once).
_parsing = threading.Lock()


def _code(thing: Any) -> str:
    """The syntax tree of `thing`'s source, without docstrings (or its name, without one)."""
    try:
        source = textwrap.dedent(inspect.getsource(thing))
    except (OSError, TypeError):  # made at run time: no source to read
        return getattr(thing, "__qualname__", repr(thing))
    with _parsing:
        tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False)
