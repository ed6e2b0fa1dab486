"""Alembic migrations for every Postgres table (generated from `projections.metadata`)."""
