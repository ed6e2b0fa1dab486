"""Every projection: each module of this package that defines `projection`.

Adding a view = a module here (its table and transform) + a migration; nothing else."""

from __future__ import annotations

import importlib
import pkgutil

import projections
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
