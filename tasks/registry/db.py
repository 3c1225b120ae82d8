"""Engine construction that gives SQLite and PostgreSQL the same locking story.

PostgreSQL: row locks (`SELECT ... FOR [NO KEY] UPDATE`) serialize writers.
SQLite has no row locks, so every transaction starts with `BEGIN IMMEDIATE`
(one writer at a time, others wait on the busy timeout) and foreign keys are
switched on, which SQLite leaves off by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url

from tasks.errors import InvalidInputError

SQLITE_BUSY_TIMEOUT_S = 60


def normalize_url(db_url: str) -> sa.URL:
    """Parse a URL; bare `postgresql://` means psycopg 3 (the driver we ship)."""
    try:
        url = make_url(db_url)
    except Exception as exc:  # sqlalchemy raises ArgumentError for garbage
        raise InvalidInputError(f"registry URL is not a valid SQLAlchemy URL: {exc}") from None
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise InvalidInputError(f"registry URL: unsupported database {url.get_backend_name()!r} (sqlite, postgresql)")
    return url


def make_engine(db_url: str, **kwargs: Any) -> sa.Engine:
    url = normalize_url(db_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}, **kwargs)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: sa.Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(url, **kwargs)
