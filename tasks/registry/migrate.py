"""Apply the registry schema migrations in `sql/` with alembic, configured in code.

The only place the schema changes (`retrainer db upgrade`, `retrainer demo`, the compose
init service); every other command checks the revision (`schema.require_head`). The
version table is `retrainer_schema_version` so the registry can share a database with
Airflow (whose metadata uses `alembic_version`). Upgrades are serialized: a PostgreSQL
advisory transaction lock, or SQLite's BEGIN IMMEDIATE, so many processes starting at
once apply each migration exactly once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from tasks import REPO_ROOT
from tasks.base.errors import RetrainerError
from tasks.registry.db import make_engine
from tasks.registry.schema import VERSION_TABLE, revision

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

# alembic logs "setup plugin ..." at INFO when imported and two lines per connection; our own line says
# what was applied. Set before alembic is first imported (below, inside the functions).
logging.getLogger("alembic").setLevel(logging.WARNING)

# Arbitrary 64-bit key for pg_advisory_xact_lock: "retrainer schema".
_PG_LOCK_KEY = 0x7265747261696E72


def sql_dir() -> Path:
    """The migrations folder: `sql/` next to the `tasks` package (editable install / repo checkout)."""
    path = REPO_ROOT / "sql"
    if not (path / "env.py").is_file():
        raise RetrainerError(f"registry migrations not found at {path} (run from a repo checkout)")
    return path


def alembic_config(connection: sa.Connection) -> Config:
    """An alembic config for `sql/` that runs on `connection` (for alembic commands beyond `upgrade`)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(sql_dir()))
    cfg.attributes["connection"] = connection
    cfg.attributes["version_table"] = VERSION_TABLE
    cfg.attributes["applied"] = []
    return cfg


def upgrade(db_url: str, engine: sa.Engine | None = None) -> list[str]:
    """Bring the registry schema to the newest revision; return the revision ids applied now (idempotent)."""
    from alembic import command

    own = engine is None
    engine = engine or make_engine(db_url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            cfg = alembic_config(conn)
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
            return revision(conn)
    finally:
        engine.dispose()
