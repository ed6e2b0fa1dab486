"""Every projection and every join: each module of this package that defines `projection`
(folds events) or `join` (joins two captured tables from their changelogs).

Adding a view = a module here (its table and transform, or its join) + a migration; nothing else."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from sqlalchemy import Table

import projections
from projections import progress
from projections.base import Join, Output, Projection


def _modules() -> list[ModuleType]:
    infos = sorted(pkgutil.iter_modules(projections.__path__), key=lambda m: m.name)
    return [importlib.import_module(f"projections.{info.name}") for info in infos]


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

# Every view the API serves. A joined view appears as a projection named after it that reads no
# events (see `ReadModel.includes` for what `consistent_with` means for it).
VIEWS: dict[str, tuple[Projection, Output]] = {
    **{o.name: (p, o) for p in PROJECTIONS.values() for o in p.outputs},
    **{j.name: (j.projection, j.output) for j in JOINS.values()},
}


def _captured() -> dict[str, Table]:
    """Tables whose changes CDC streams into `cdc.<table>`: every view (joined ones too), the
    projections' progress (a rebuild shows there as a new generation), and every plain table
    a module of this package lists in `plain_tables` (written with SQL, outside the event log)."""
    found = {o.name: o.table for _, o in VIEWS.values()}
    found[progress.table.name] = progress.table
    for module in _modules():
        for table in getattr(module, "plain_tables", ()):
            found[table.name] = table
    return dict(sorted(found.items()))


def _check_inputs(joins: dict[str, Join], captured: dict[str, Table]) -> None:
    for join in joins.values():
        missing = [t for t in join.tables if t not in captured]
        if missing:
            raise ValueError(f"join {join.name} reads {missing}, which CDC does not capture")


CAPTURED: dict[str, Table] = _captured()
_check_inputs(JOINS, CAPTURED)
