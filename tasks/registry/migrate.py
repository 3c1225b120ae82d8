"""Apply the registry schema migrations in `sql/` with alembic, configured in code.

The version table is `retrainer_schema_version` so the registry can share a
database with Airflow (whose metadata uses `alembic_version`). Upgrades are
serialized: a PostgreSQL advisory transaction lock, or SQLite's BEGIN IMMEDIATE,
so many processes starting at once apply each migration exactly once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

import tasks
from tasks.errors import RetrainerError
from tasks.registry.db import make_engine

log = logging.getLogger(__name__)

VERSION_TABLE = "retrainer_schema_version"
# alembic logs two lines per connection at INFO ("Context impl ..."); every stage upgrades the schema
# (idempotently), so keep that chatter out of task logs. Our own line says what was applied.
logging.getLogger("alembic.runtime.migration").setLevel(logging.WARNING)

# Arbitrary 64-bit key for pg_advisory_xact_lock: "retrainer schema".
_PG_LOCK_KEY = 0x7265747261696E72


def sql_dir() -> Path:
    """The migrations folder: `sql/` next to the `tasks` package (editable install / repo checkout)."""
    path = Path(tasks.__file__).resolve().parent.parent / "sql"
    if not (path / "env.py").is_file():
        raise RetrainerError(f"registry migrations not found at {path} (run from a repo checkout)")
    return path


def _config(connection: sa.Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(sql_dir()))
    cfg.attributes["connection"] = connection
    cfg.attributes["applied"] = []
    return cfg


def upgrade(db_url: str, engine: sa.Engine | None = None) -> list[str]:
    """Bring the registry schema to the newest revision; return the revision ids applied now."""
    own = engine is None
    engine = engine or make_engine(db_url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            cfg = _config(conn)
            command.upgrade(cfg, "head")
            applied = list(cfg.attributes["applied"])
    finally:
        if own:
            engine.dispose()
    if applied:
        log.info("registry schema upgraded: %s", ", ".join(applied))
    return applied


def current(db_url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""
    engine = make_engine(db_url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(VERSION_TABLE):
                return None
            return conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    finally:
        engine.dispose()
