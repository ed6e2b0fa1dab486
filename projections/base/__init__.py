"""The machinery of the views, apart from the views themselves (one module each in
`projections/`): how a view is declared (`declarations`, re-exported here), how an event's rows
are built in Spark (`rows`, the one module here that imports pyspark), the folds' progress and
the joins' state (their tables), and how values look on the wire. The registry does not scan
this package."""

from __future__ import annotations

from projections.base.declarations import (
    JOIN_STATE,
    ROLES,
    Fold,
    Join,
    Offsets,
    Output,
    Projection,
    Role,
    Side,
    View,
)

__all__ = [
    "JOIN_STATE",
    "ROLES",
    "Fold",
    "Join",
    "Offsets",
    "Output",
    "Projection",
    "Role",
    "Side",
    "View",
]
