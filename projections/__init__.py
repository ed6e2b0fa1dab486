"""Read views: one module per view with its table (on the shared `metadata`) and its fold."""

from __future__ import annotations

from sqlalchemy import MetaData

metadata = MetaData()
