"""Every projection and every join: each module of this package that defines `projection`
(folds events) or `join` (joins two captured tables from their changelogs).

Adding a view = a module here (its table and rows, or its join) + a migration; nothing else.
Importing this module never loads Spark (a view imports its row functions when it runs)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from sqlalchemy import Table

import projections
from projections.base import (
    Fold,
    Join,
    Projection,
    View,
    join_state,  # noqa: F401  (its table, on the shared metadata)
    progress,
)


def _modules() -> list[ModuleType]:
    """Every view module of the package (not its subpackages: `base` is the machinery)."""
    infos = sorted(pkgutil.iter_modules(projections.__path__), key=lambda m: m.name)
    names = [i.name for i in infos if not i.ispkg and not i.name.startswith("_")]
    return [importlib.import_module(f"projections.{name}") for name in names]


def _discover() -> dict[str, Projection]:
    found = {}
    for module in _modules():
        projection = getattr(module, "projection", None)
        if isinstance(projection, Projection):
            found[projection.name] = projection
    return found


def _joins() -> dict[str, Join]:
    found = {}
    for module in _modules():
        join = getattr(module, "join", None)
        if isinstance(join, Join):
            if join.name in PROJECTIONS:  # both keep their progress under their name
                raise ValueError(f"join {join.name} has the name of a projection")
            found[join.name] = join
    return found


PROJECTIONS: dict[str, Projection] = _discover()

JOINS: dict[str, Join] = _joins()

# Everything the read side folds, each with its own progress row.
FOLDS: dict[str, Fold] = {**PROJECTIONS, **JOINS}

# Every view the API serves, with the fold that writes it.
VIEWS: dict[str, tuple[Fold, View]] = {v.name: (f, v) for f in FOLDS.values() for v in f.views}


def writers(fold: Fold) -> list[Fold]:
    """The folds that write the tables `fold` reads through their changelogs."""
    return [f for f in FOLDS.values() if any(v.name in fold.inputs for v in f.views)]


def _captured() -> dict[str, Table]:
    """Tables whose changes CDC streams into `cdc.<table>`: every view (joined ones too), the
    projections' progress (a rebuild shows there as a new generation), and every plain table
    a module of this package lists in `plain_tables` (written with SQL, outside the event log)."""
    found = {v.name: v.table for _, v in VIEWS.values()}
    found[progress.table.name] = progress.table
    for module in _modules():
        for table in getattr(module, "plain_tables", ()):
            found[table.name] = table
    return dict(sorted(found.items()))


def _check_inputs(folds: dict[str, Fold], captured: dict[str, Table]) -> None:
    for fold in folds.values():
        missing = [t for t in fold.inputs if t not in captured]
        if missing:
            raise ValueError(f"{fold.name} reads {missing}, which CDC does not capture")


CAPTURED: dict[str, Table] = _captured()
_check_inputs(FOLDS, CAPTURED)
