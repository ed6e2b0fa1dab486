"""The migrations create exactly the tables the projections declare (nothing to autogenerate)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import commands.keys  # noqa: F401  (the subjects' keys)
import projections.base.progress
import projections.registry  # noqa: F401  (every view's table)
import webhooks.tables  # noqa: F401  (the webhook endpoints and dead letters)
from config.settings import Settings, sqlalchemy_url
from projections import metadata
from stack.migrate import upgrade
from tests.support import new_deployment


def test_head_matches_the_declared_tables(base_settings: Settings) -> None:
    settings = new_deployment(base_settings)
    engine = sa.create_engine(sqlalchemy_url(settings.database()))
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == []
    assert {
        "customers",
        "books",
        "orders",
        "author_royalties",
        "sales_by_hour",
        "late_events",
        "projection_progress",
    } <= tables


def test_upgrading_twice_is_harmless(base_settings: Settings) -> None:
    settings = new_deployment(base_settings)
    upgrade(settings.database())
    upgrade(settings.database())


def test_the_webhooks_migration_round_trips(base_settings: Settings) -> None:
    from alembic import command

    from stack.migrate import alembic_config

    settings = new_deployment(base_settings)
    config = alembic_config(settings.database())

    def webhook_tables() -> set[str]:
        engine = sa.create_engine(sqlalchemy_url(settings.database()))
        try:
            with engine.connect() as conn:
                return {t for t in sa.inspect(conn).get_table_names() if t.startswith("webhook")}
        finally:
            engine.dispose()

    assert webhook_tables() == {"webhook_endpoints", "webhook_dead_letters"}
    command.downgrade(config, "0012")
    assert webhook_tables() == set()
    upgrade(settings.database())
    assert webhook_tables() == {"webhook_endpoints", "webhook_dead_letters"}
