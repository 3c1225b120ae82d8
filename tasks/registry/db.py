"""Engine construction that gives SQLite and PostgreSQL the same locking story.

PostgreSQL: row locks (`SELECT ... FOR [NO KEY] UPDATE`) serialize writers.
SQLite has no row locks, so every transaction starts with `BEGIN IMMEDIATE`
(one writer at a time, others wait on the busy timeout) and foreign keys are
switched on, which SQLite leaves off by default.

PostgreSQL connections are checked at pool checkout without a round trip: a
pooled connection whose socket is readable while idle has been closed by the
server (restart, idle timeout, terminated backend) or has unexpected pending
input, so the pool drops it and connects afresh. `pool_pre_ping` did the same
with one extra round trip per checkout, a third of the cost of an alias switch.

The PostgreSQL pool is small on purpose (PG_POOL_SIZE, no overflow): every switch of
one alias serializes on that alias's row lock, and a queue of backends on one row
costs a wake-up and a context switch per hand-off. Threads beyond the pool wait
in-process, which is cheaper: 32 writer threads on 34 connections made 1,100-2,000
switches/s here, on 4 connections 2,900-3,100/s (BENCHMARKS.md). Pass `pool_size=`
to `make_engine` for a process that serves many models at once.
"""

from __future__ import annotations

import logging
import select
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url

from tasks.base.errors import InvalidInputError

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_S = 60
PG_POOL_SIZE = 4


def _idle_socket_has_input(dbapi_conn: Any) -> bool:
    """True when an idle psycopg connection is closed or has input waiting (EOF counts): do not reuse it."""
    if getattr(dbapi_conn, "closed", False):
        return True
    try:
        fd = dbapi_conn.fileno()
    except Exception:  # psycopg raises OperationalError on a closed connection
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


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
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", PG_POOL_SIZE)
        kwargs.setdefault("max_overflow", 0)
    engine = sa.create_engine(url, **kwargs)
    if not kwargs.get("pool_pre_ping"):

        @event.listens_for(engine, "checkout")
        def _on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
            if _idle_socket_has_input(dbapi_conn):
                log.info("registry: pooled connection was closed by the server; reconnecting")
                raise sa.exc.DisconnectionError("pooled connection closed by the server")

    return engine
