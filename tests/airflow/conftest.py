"""Fixtures for the issue-8 Airflow tests: one real `airflow standalone` for the module that needs it.

The standalone gets its own AIRFLOW_HOME, RETRAINER_HOME and config folder (a shrunk copy
of the demo config, no schedule), its own port, parallelism 4, a fast DAG-folder refresh,
and is started in its own session so the whole process group is stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def write_test_config(home: Path, update: dict[str, Any] | None = None) -> Path:
    """The demo config, shrunk for CPU CI: a few steps, warm-up off so more steps always means lower loss.
    `update`: sections a test module changes (each merged into the section, or set when new)."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["schedule"] = None  # runs only when the test triggers them
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32, dropout=0.0)
    cfg["train"].update(steps=4, checkpoint_every=2, micro_batch_size=4, warmup_steps=0, lr=1.0e-2,
                        output_dir=str(home / "runs"))
    cfg["data"].update(source_url=str(home / "store" / "data"), cache_dir=str(home / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=4)
    cfg["publish"].update(registry_url=f"sqlite:///{home / 'registry.db'}", store_url=str(home / "store" / "models"))
    for section, values in (update or {}).items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    config_dir = home / "configs"
    config_dir.mkdir(parents=True)
    path = config_dir / "tiny-llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Standalone:
    """A running `airflow standalone` and an authenticated REST client for it."""

    proc: subprocess.Popen
    base_url: str
    home: Path
    config_path: Path
    log_path: Path
    token: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, authenticated: bool = True) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.auth if authenticated else {}, timeout=60)

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> httpx.Response:
        with self.client() as c:
            return c.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                run = c.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").raise_for_status().json()
                if run["state"] in ("success", "failed"):
                    return run
                assert self.proc.poll() is None, f"airflow standalone died:\n{self.log_tail()}"
                time.sleep(2)
        raise AssertionError(f"{dag_id} run {run_id} did not finish in {timeout}s:\n{self.log_tail()}")

    def run_ids(self, dag_id: str) -> set[str]:
        with self.client() as c:
            runs = c.get(f"/api/v2/dags/{dag_id}/dagRuns").raise_for_status().json()["dag_runs"]
        return {r["dag_run_id"] for r in runs}

    def next_run(self, dag_id: str, known: set[str], timeout: float = 300) -> str:
        """The id of a run of `dag_id` that is not in `known` (one the scheduler started on an Asset event)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = sorted(self.run_ids(dag_id) - known)
            if new:
                return new[0]
            time.sleep(1)
        raise AssertionError(f"no new {dag_id} run in {timeout}s:\n{self.log_tail()}")

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        with self.client() as c:
            tis = c.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").raise_for_status().json()
        return {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        with self.client() as c:
            url = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
            return c.get(url, params={"full_content": True}).raise_for_status().text

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(sa: Standalone, dag_ids: list[str], timeout: float = 300) -> None:
    """API up, admin password generated, token issued, and our DAGs parsed."""
    deadline = time.monotonic() + timeout
    password_file = sa.home / "airflow" / "simple_auth_manager_passwords.json.generated"
    while time.monotonic() < deadline:
        assert sa.proc.poll() is None, f"airflow standalone exited early:\n{sa.log_tail()}"
        try:
            with httpx.Client(base_url=sa.base_url, timeout=10) as c:
                healthy = c.get("/api/v2/monitor/health").status_code == 200
                if healthy and password_file.exists() and not sa.token:
                    password = json.loads(password_file.read_text())["admin"]
                    resp = c.post("/auth/token", json={"username": "admin", "password": password})
                    if resp.status_code in (200, 201):
                        sa.token = resp.json()["access_token"]
                if sa.token and all(
                    c.get(f"/api/v2/dags/{d}", headers=sa.auth).status_code == 200 for d in dag_ids
                ):
                    return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"airflow standalone not ready in {timeout}s:\n{sa.log_tail()}")


@pytest.fixture(scope="module")
def standalone_config() -> dict[str, Any]:
    """Config sections a test module changes for its standalone (override this fixture there); none here."""
    return {}


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory, standalone_config: dict[str, Any]) -> Iterator[Standalone]:
    from tasks.data import make_data
    from tasks.registry import upgrade

    home = tmp_path_factory.mktemp("standalone")
    config_path = write_test_config(home, standalone_config)
    upgrade(f"sqlite:///{home / 'registry.db'}")  # the deployment's `retrainer db upgrade`
    make_data(str(home / "store" / "data"), name="tiny-llama", n_train_shards=2, tokens_per_shard=16384)
    port = free_port()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__LAZY_LOAD_PLUGINS": "False",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__WORKERS": "1",
        "RETRAINER_CONFIG_DIR": str(config_path.parent),
        "RETRAINER_HOME": str(home / "retrainer"),
        "OMP_NUM_THREADS": "1",
        # standalone starts its components as `airflow ...` from PATH: this venv's.
        "PATH": os.pathsep.join((str(Path(AIRFLOW).parent), os.environ.get("PATH", ""))),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("RETRAINER_DB_URL", None)
    log_path = home / "standalone.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([AIRFLOW, "standalone"], env=env, cwd=home, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    sa = Standalone(proc=proc, base_url=f"http://127.0.0.1:{port}", home=home, config_path=config_path,
                    log_path=log_path)
    try:
        deploys = ["deploy_tiny-llama"] if standalone_config.get("deploy", {}).get("enabled") else []
        _wait_ready(sa, ["retrain_tiny-llama", "rollback_model", *deploys])
        # The training pool the retrain DAG's train task occupies (README: create it once per cluster).
        subprocess.run([AIRFLOW, "pools", "set", "training-local", "8", "GPU slots on this machine"],
                       env=env, check=True, capture_output=True, timeout=120)
        yield sa
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """TERM the whole process group (scheduler, workers, api-server...), then KILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=10)
