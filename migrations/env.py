from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

import cdc.state  # noqa: F401
import commands.keys  # noqa: F401
import projections.base.progress
import projections.registry  # noqa: F401  (loads every view's table)
import webhooks.tables  # noqa: F401
from projections import metadata

config = context.config
if not config.get_main_option("sqlalchemy.url"):
    from config.settings import Settings, sqlalchemy_url

    config.set_main_option("sqlalchemy.url", sqlalchemy_url(Settings().database()))


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
