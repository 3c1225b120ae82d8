"""Experiment lock: one training of an experiment at a time, across DAGs, the CLI and deployments.

On PostgreSQL the lock is a session advisory lock held on a dedicated
connection: it dies with its holder (a SIGKILLed worker frees it at once). The
holder's description is put in `application_name`, so a refused caller can name
who holds it from `pg_stat_activity`. On SQLite (the embedded default) the
equivalent is an `flock` on a file beside the registry database, with the
holder's description in a sidecar file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from filelock import FileLock, Timeout

from tasks.base.audit import default_actor
from tasks.base.errors import LockHeldError

log = logging.getLogger(__name__)


def default_holder(context: str = "") -> str:
    """Who holds a lock (`alice@host pid 123 (cli)`): the person, and the process that can be found and ended."""
    who = f"{default_actor()}@{socket.gethostname()} pid {os.getpid()}"
    return f"{who} ({context})" if context else who


def advisory_key(experiment_key: str) -> int:
    """A signed 64-bit advisory lock id from the experiment key's hex digest."""
    return int.from_bytes(bytes.fromhex(experiment_key[:16]), "big", signed=True)


@contextmanager
def experiment_lock(registry_url: str, experiment_key: str, holder: str | None = None) -> Iterator[None]:
    """Hold the lock for `experiment_key` or fail fast with LockHeldError naming the holder."""
    holder = holder or default_holder()
    url = sa.make_url(registry_url)
    if url.get_backend_name() == "postgresql":
        with _pg_lock(url, experiment_key, holder):
            yield
    elif url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        with _file_lock(Path(url.database), experiment_key, holder):
            yield
    else:
        raise ValueError(f"publish.registry_url: no experiment lock for backend {url.get_backend_name()!r}")


@contextmanager
def _pg_lock(url: sa.URL, experiment_key: str, holder: str) -> Iterator[None]:
    key = advisory_key(experiment_key)
    # A dedicated, unpooled connection: the lock lives exactly as long as this session.
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(sa.text("SELECT set_config('application_name', :n, false)"),
                         {"n": f"retrainer-lock: {holder}"[:63]})
            if not conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
                raise LockHeldError(
                    f"experiment {experiment_key[:12]} is already being trained by {_pg_holder(conn, key)}"
                )
            log.info("experiment lock %s taken by %s", experiment_key[:12], holder)
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        engine.dispose()


def _pg_holder(conn: sa.Connection, key: int) -> str:
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    row = conn.execute(
        sa.text(
            "SELECT a.application_name, a.pid, a.client_addr FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo "
            "AND l.objsubid = 1"
        ),
        {"hi": unsigned >> 32, "lo": unsigned & 0xFFFFFFFF},
    ).first()
    if row is None:
        return "another session (it has just released the lock; retry)"
    name = (row.application_name or "").removeprefix("retrainer-lock: ") or "an unnamed session"
    return f"{name} [backend pid {row.pid}, client {row.client_addr or 'local'}]"


@contextmanager
def _file_lock(database: Path, experiment_key: str, holder: str) -> Iterator[None]:
    lock_dir = database.parent / f"{database.name}.locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock_path = lock_dir / f"{experiment_key[:32]}.lock"
    holder_path = lock_path.with_suffix(".holder")
    lock = FileLock(lock_path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        current = _file_holder(holder_path)
        raise LockHeldError(f"experiment {experiment_key[:12]} is already being trained by {current}") from None
    try:
        holder_path.write_text(json.dumps({"holder": holder}))
        log.info("experiment lock %s taken by %s", experiment_key[:12], holder)
        yield
    finally:
        holder_path.unlink(missing_ok=True)
        lock.release()


def _file_holder(holder_path: Path, wait_s: float = 5.0) -> str:
    """The holder's name; it writes it just after taking the lock, so a contender that lost the race
    by microseconds polls briefly instead of reporting an anonymous holder."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return json.loads(holder_path.read_text())["holder"]
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                return "another process"
            time.sleep(0.02)
