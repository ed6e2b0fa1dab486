"""Every projection. Adding a view = a module in projections/ + a line here + a migration."""

from __future__ import annotations

from projections import author_royalties, books, customers, orders, sales_by_hour
from projections.base import Output, Projection

PROJECTIONS: dict[str, Projection] = {
    p.name: p
    for p in (
        customers.projection,
        books.projection,
        orders.projection,
        author_royalties.projection,
        sales_by_hour.projection,
    )
}

VIEWS: dict[str, tuple[Projection, Output]] = {
    o.name: (p, o) for p in PROJECTIONS.values() for o in p.outputs
}
