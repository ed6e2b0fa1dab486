"""`page_views`: a customer looked at a book's page (the reference stream)."""

from __future__ import annotations

from dataclasses import dataclass

from commands.fields import Id


@dataclass(frozen=True)
class PageView:
    """A customer looked at a book's page."""

    customer_id: Id
    book_id: Id
