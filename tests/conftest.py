"""Shared fixtures: real PostgreSQL and a real S3 HTTP endpoint, started once per session."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  (it binds its loggers to the sys.stderr of its import: pytest's session-wide capture)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "plugins"))  # as Airflow puts it on every component's path (the Airflow contract)

from tests.services import AIRFLOW_TEST_USERS, IN_CI, PgCluster, S3Endpoint, require, require_binary  # noqa: E402
from tests.slurm import SlurmCluster, slurm_daemons  # noqa: E402

# Keep torch from oversubscribing 2 cores when several ranks run at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# One private Airflow home for the whole test session (each xdist worker its own: its SQLite metadata database
# is migrated by the worker's `airflow_db`), set before anything imports airflow (Airflow reads its
# configuration once, at import). Tests never touch the user's ~/airflow.
_AIRFLOW_HOME_VAR = f"RETRAINER_TEST_AIRFLOW_HOME_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
if _AIRFLOW_HOME_VAR not in os.environ:
    os.environ[_AIRFLOW_HOME_VAR] = tempfile.mkdtemp(prefix="retrainer-airflow-")
os.environ["AIRFLOW_HOME"] = os.environ[_AIRFLOW_HOME_VAR]
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ.setdefault("AIRFLOW__CORE__PARALLELISM", "4")
os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] = AIRFLOW_TEST_USERS


@functools.cache
def _shares_the_standalone(module: str) -> bool:
    """Whether a test module runs on the package's shared Airflow standalone: it declares its `TENANT`
    (tests/airflow/conftest.py asserts every module using the fixture does)."""
    path = ROOT / module
    return path.is_file() and re.search(r"^TENANT = ", path.read_text(), re.MULTILINE) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadscope` (`scripts/test.sh`: three workers) a test file is one unit of work, so its module
    fixtures start once, and all the modules sharing the Airflow standalone are one unit, so one worker starts
    it and runs them while the other workers run the rest (they mostly wait on its scheduler). By file here,
    not by xdist_group marks: xdist 3.8 cannot rename node ids under pytest 9.2."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/airflow (the shared standalone)" if _shares_the_standalone(module) else module

    return ByModule(config, log)


@pytest.hookimpl(trylast=True)  # after tests/airflow/conftest.py put the standalone's modules last in their package
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On an xdist worker, the order units are handed out in (`--no-loadscope-reorder`): the standalone's
    modules first (the longest unit), then the modules that start several processes, then the rest, so the
    last minutes are short units on every worker. A module's tests stay together and in file order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    first: dict[Path, int] = {}
    heavy: set[Path] = set()
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
        if item.get_closest_marker("multiproc") is not None:
            heavy.add(item.path)

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = str(item.path.relative_to(ROOT))
        return (0 if _shares_the_standalone(module) else 1 if item.path in heavy else 2), first[item.path]

    items.sort(key=rank)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    require(PgCluster.available(), "PostgreSQL server binaries (initdb, pg_ctl)")
    # Outside pytest's rotating basetemp: a concurrent pytest session may prune that under a live server.
    root = Path(tempfile.mkdtemp(prefix="retrainer-pg-"))
    cluster = PgCluster.create(root)
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> str:
    """A fresh, empty PostgreSQL database for one test."""
    return pg_cluster.create_database()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each registry test runs against both backends."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    endpoint = S3Endpoint.start()
    yield endpoint
    endpoint.stop()


@pytest.fixture
def s3_bucket(s3: S3Endpoint) -> str:
    """A fresh bucket for one test; returns its name."""
    return s3.create_bucket()


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated Airflow metadata DB (SQLite in the session's AIRFLOW_HOME); returns AIRFLOW_HOME."""
    import subprocess

    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], check=True, capture_output=True, timeout=600)
    # `import airflow` configures its logging on the sys.stdout of that moment: here, under pytest's session-wide
    # capture, not first inside a test whose capsys/capfd stream is closed after it (every later Airflow log
    # line on this worker would be a "Logging error: I/O operation on closed file" traceback).
    import airflow

    return os.environ["AIRFLOW_HOME"]


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return IN_CI


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch):
    """Test hooks for launchers this test process runs: `hooked(HOOK_STEP_DELAY_S="1")` (tests/hooks)."""
    from tests import hooks

    def install(**env: str) -> None:
        for name, value in env.items():
            assert name.startswith(hooks.PREFIX), name
            monkeypatch.setenv(name, value)
        hooks.install(monkeypatch.setattr)

    return install


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require(os.geteuid() == 0, "root (slurmd runs jobs as root here)")
    for binary in ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol"):
        require_binary(binary)
    yield from slurm_daemons(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(autouse=True)
def no_log_handler_left_on_a_closed_stream() -> Iterator[None]:
    """Fails the test that leaves a logging handler writing to its closed capsys/capfd stream (a library that
    configures logging when a test first imports it): every later log line on that worker would be a "Logging
    error" traceback in another module's output."""
    yield
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    left = [f"{lg.name} ({type(h).__name__})" for lg in loggers for h in lg.handlers
            if getattr(getattr(h, "stream", None), "closed", False)]
    assert not left, f"logging handlers left on this test's closed capture stream: {left}"
