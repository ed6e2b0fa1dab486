"""Alembic, driven from code so `logfold migrate` works from an installed package too."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations
from config.settings import sqlalchemy_url


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


READER = "logfold_reader"  # made by migration 0007; reads what 0012 grants it
WEBHOOKS = "logfold_webhooks"  # made by migration 0013; writes the webhook tables only
DEAD_LETTERS = "logfold_dead_letters"  # made by migration 0015; marks parked events only


def ensure_login(owner_url: str, login_url: str) -> str:
    """Make the login of `login_url` (its user, with its password) a member of `logfold_reader`
    (and of `logfold_webhooks`, which writes the webhook tables only, and `logfold_dead_letters`,
    which asks for retries and skips of parked events only): created if missing, its
    password set to the URL's. Run as the owner of `owner_url`, which needs CREATEROLE.
    Returns the login's name; ValueError when it is the owner itself."""
    from urllib.parse import unquote, urlsplit

    import psycopg
    from psycopg import sql

    owner, login = urlsplit(owner_url), urlsplit(login_url)
    if not login.username:
        raise ValueError("LOGFOLD_API_DATABASE_URL names no user")
    role = unquote(login.username)
    if role == unquote(owner.username or ""):
        raise ValueError(f"LOGFOLD_API_DATABASE_URL logs in as {role}, the owner of the tables")
    password = unquote(login.password) if login.password else None
    with psycopg.connect(owner_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        make = sql.SQL("ALTER ROLE {} LOGIN" if exists else "CREATE ROLE {} LOGIN")
        statement = make.format(sql.Identifier(role))
        if password is not None:
            statement = sql.SQL("{} PASSWORD {}").format(statement, sql.Literal(password))
        conn.execute(statement)
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(READER), sql.Identifier(role)))
        # The API registers webhook endpoints (their tables, and no other, are its to write) and
        # asks for retries and skips of parked events (marks on them, carried out elsewhere).
        for writer in (WEBHOOKS, DEAD_LETTERS):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (writer,)).fetchone():
                grant = sql.SQL("GRANT {} TO {}")
                conn.execute(grant.format(sql.Identifier(writer), sql.Identifier(role)))
    return role
