"""Real services for tests and benchmarks: a throwaway PostgreSQL cluster, an S3 endpoint and an MLflow server.

No mocks: the PostgreSQL server is the real binary started on a private port and
socket directory, and S3 is moto's HTTP server (spoken to over HTTP by s3fs).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Airflow users of every role (the simple auth manager's `name:role` list), for the in-process API app and the
# standalone alike: the trust tests act as each of them (README: who may do what).
AIRFLOW_TEST_USERS = "admin:admin,alice:op,op1:op,user1:user,viewer1:viewer"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(condition: bool, what: str) -> None:
    """Skip locally when a dependency is missing; fail under CI=true (a skip would hide it)."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"missing test dependency under CI: {what}")
    pytest.skip(f"missing test dependency: {what}")


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"binary {name!r} not on PATH")
    assert path is not None
    return path


# Ports handed to servers a test starts: above the product's default rendezvous ports (tasks.config
# MASTER_PORTS) and below Linux's ephemeral range (32768+). A port the OS picks from the ephemeral range is
# free when picked but can be taken, before the server binds it, as the local port of any outgoing
# connection (seen: torchrun's rendezvous failing with EADDRINUSE while the other xdist worker ran).
TEST_PORTS = range(30000, 32768)


_handed_out: set[int] = set()


def _worker_ports() -> range:
    """This xdist worker's own slice of TEST_PORTS: a port handed out here is never handed to another worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index, count = int(worker.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(TEST_PORTS) // count
    return TEST_PORTS[index * size:(index + 1) * size]


def free_port() -> int:
    """A port free now, from this worker's slice of TEST_PORTS, never handed out before in this session: a port
    reserved early and bound late (a DAG config's rendezvous port, used minutes later) is not handed to a server
    started in between (seen: a standalone's training failing with EADDRINUSE on its config's port)."""
    rng = random.SystemRandom()
    candidates = [port for port in _worker_ports() if port not in _handed_out]
    for _ in range(200):
        if not candidates:
            break
        port = candidates.pop(rng.randrange(len(candidates)))
        _handed_out.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port left in {_worker_ports()}")


def stop_daemon(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM a test daemon, SIGKILL it if it has not exited within `timeout_s`, and reap it."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb refuses root: run the server binaries as the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@dataclass
class PgCluster:
    """A private PostgreSQL cluster (trust auth, fsync off) on its own port."""

    datadir: Path
    port: int

    @classmethod
    def available(cls) -> bool:
        return _pg_bin("initdb") is not None and _pg_bin("pg_ctl") is not None

    @classmethod
    def create(cls, root: Path) -> PgCluster:
        root.mkdir(parents=True, exist_ok=True)
        # Parents must be traversable by the postgres user.
        for parent in [root, *root.parents]:
            if str(parent) in ("/", ""):
                break
            with contextlib.suppress(PermissionError):
                parent.chmod(parent.stat().st_mode | 0o755)
        datadir = root / "pgdata"
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        subprocess.run(
            _as_postgres([_pg_bin("initdb") or "initdb", "-D", str(datadir), "--auth=trust", "--no-sync",
                          "-U", "postgres", "-E", "UTF8"]),
            check=True, capture_output=True,
        )
        cluster = cls(datadir=datadir, port=free_port())
        cluster.start()
        return cluster

    def _ctl(self, *args: str) -> None:
        opts = (f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200 -c synchronous_commit=off")
        subprocess.run(
            _as_postgres([_pg_bin("pg_ctl") or "pg_ctl", "-D", str(self.datadir), "-w", "-t", "60",
                          "-l", str(self.datadir / "server.log"), "-o", opts, *args]),
            check=True, capture_output=True,
        )

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        self._ctl("stop", "-m", "fast")

    def restart(self) -> None:
        self._ctl("restart", "-m", "fast")

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """Create a fresh database and return its SQLAlchemy URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@dataclass
class S3Endpoint:
    """moto's S3 HTTP server on a private port."""

    server: Any
    endpoint_url: str
    key: str = "testing-key"
    secret: str = "testing-secret"

    @classmethod
    def start(cls, ip: str = "127.0.0.1") -> S3Endpoint:
        """On `ip` (loopback by default; an address of the test hosts' bridge for the ssh tests)."""
        from moto.server import ThreadedMotoServer

        port = free_port()
        server = ThreadedMotoServer(ip_address=ip, port=port, verbose=False)
        server.start()
        return cls(server=server, endpoint_url=f"http://{ip}:{port}")

    def stop(self) -> None:
        self.server.stop()

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options (no region: these endpoints do not want one)."""
        return {"key": self.key, "secret": self.secret, "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name


@dataclass
class MlflowServer:
    """A real `mlflow server` on a private port: SQLite backend store, artifacts in a local folder."""

    proc: subprocess.Popen
    uri: str

    @classmethod
    def start(cls, root: Path, timeout_s: float = 120.0) -> MlflowServer:
        require(importlib.util.find_spec("mlflow") is not None, "mlflow (pip install -e '.[test]')")
        root.mkdir(parents=True, exist_ok=True)
        port = free_port()
        log = open(root / "server.log", "wb")  # noqa: SIM115 (the server's, closed with it)
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                                                       # no job consumers (GenAI judges): six processes of imports
                                                       "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        log.close()
        server = cls(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        while True:  # poll until it answers (its database is created on start)
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({proc.returncode}): "
                                   f"{(root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return server
            except OSError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"mlflow server did not answer within {timeout_s:.0f}s")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_daemon(self.proc, 10)
