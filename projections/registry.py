"""Every projection: each module of this package that defines `projection`.

Adding a view = a module here (its table and transform) + a migration; nothing else."""

from __future__ import annotations

import importlib
import pkgutil

from sqlalchemy import Table

import projections
from projections import progress
from projections.base import Output, Projection


def _discover() -> dict[str, Projection]:
    found = {}
    for info in sorted(pkgutil.iter_modules(projections.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"projections.{info.name}")
        projection = getattr(module, "projection", None)
        if isinstance(projection, Projection):
            found[projection.name] = projection
    return found


PROJECTIONS: dict[str, Projection] = _discover()

VIEWS: dict[str, tuple[Projection, Output]] = {
    o.name: (p, o) for p in PROJECTIONS.values() for o in p.outputs
}


def _captured() -> dict[str, Table]:
    """Tables whose changes CDC streams into `cdc.<table>`: every view, the projections'
    progress (a rebuild shows there as a new generation), and every plain table a module
    of this package lists in `plain_tables` (written with SQL, outside the event log)."""
    found = {o.name: o.table for _, o in VIEWS.values()}
    found[progress.table.name] = progress.table
    for info in pkgutil.iter_modules(projections.__path__):
        module = importlib.import_module(f"projections.{info.name}")
        for table in getattr(module, "plain_tables", ()):
            found[table.name] = table
    return dict(sorted(found.items()))


CAPTURED: dict[str, Table] = _captured()
