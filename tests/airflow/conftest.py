"""Fixtures for the Airflow tests: one real `airflow standalone` for the whole package, shared by every module.

The standalone is started as the README tells a user to (`README_AIRFLOW_COMMANDS`, run through the
venv's `retrainer airflow` wrapper; tests/airflow/test_airflow_cmd.py checks they are the README's lines),
in an environment stripped of every AIRFLOW_*/RETRAINER_* variable and of the venv's bin on PATH, so
whatever the wrapper fails to set fails every standalone test. On top it gets only settings the README
names (its own AIRFLOW_HOME, RETRAINER_HOME, config folder, and a free AIRFLOW__API__PORT, without the
base URL) and harness tuning the instructions do not depend on (a fast DAG-folder refresh, one API worker,
one OpenMP thread, this checkout first on PYTHONPATH). It is started in its own session so the whole
process group is stopped at the end.

Several models share one config folder, as the product allows: each module using the standalone declares
its `TENANT` (its models, each a shrunk copy of the demo config changed by the module, with its own data,
runs, registry and store under `home/<model>/`; the DAGs it needs; its pools; whether it needs the test hooks;
and whether its models train on Slurm). All are written before the one standalone starts (a start costs a
database migration, pools, the boot and a DAG parse), and the modules using it run last in the package, so
it idles beside no other test and is stopped when the package ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tasks import REPO_ROOT
from tests.hooks import set_step_delay
from tests.services import AIRFLOW_TEST_USERS, free_port

ROOT = REPO_ROOT
RETRAINER = str(Path(sys.executable).with_name("retrainer"))  # the venv's console script
PASSWORD_FILE = "simple_auth_manager_passwords.json.generated"
LINEAGE_EVENTS = "openlineage.jsonl"  # the standalone's OpenLineage events, one JSON per line

# The README's "Under Airflow" commands after `retrainer`, in its order; the last one keeps running.
README_AIRFLOW_COMMANDS = [
    ["airflow", "db", "migrate"],
    ["airflow", "pools", "set", "training-local", "8", "GPU slots on this machine", "--include-deferred"],
    ["airflow", "standalone"],
]


def under_airflow_bash_blocks() -> list[str]:
    """The bash blocks of the README's "Under Airflow" section, in order (what its reader types)."""
    section = (ROOT / "README.md").read_text().split("### Under Airflow", 1)[1].split("\n### ", 1)[0]
    return [block.split("```", 1)[0] for block in section.split("```bash\n")[1:]]


Mutate = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Tenant:
    """One test module's share of the standalone: its models (name -> how the module changes the test config),
    the DAGs it needs parsed, its pools (besides the README's), whether its runs need the test hooks (tests/hooks,
    then installed in every process of the standalone, their step delay set per model: `set_step_delay`), and
    whether its models train on the session's Slurm."""

    models: dict[str, Mutate | None]
    dag_ids: tuple[str, ...]
    pools: dict[str, int] = field(default_factory=dict)
    hooks: bool = False
    slurm: bool = False


def write_test_config(config_dir: Path, model_home: Path, name: str, mutate: Mutate | None = None) -> None:
    """The demo config as model `name`, shrunk for CPU CI: a few steps, warm-up off so more steps always means
    lower loss; its data, runs, cache, registry and store under `model_home`. `mutate` changes the document
    further (a test module's own settings) before it is written."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["name"] = cfg["publish"]["model_name"] = name
    cfg["schedule"] = None  # runs only when the test triggers them
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32, dropout=0.0)
    cfg["train"].update(steps=4, checkpoint_every=2, micro_batch_size=4, warmup_steps=0, lr=1.0e-2,
                        output_dir=str(model_home / "runs"))
    cfg["data"].update(source_url=str(model_home / "store" / "data"), cache_dir=str(model_home / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=4)
    cfg["publish"].update(registry_url=f"sqlite:///{model_home / 'registry.db'}",
                          store_url=str(model_home / "store" / "models"))
    if mutate is not None:
        mutate(cfg)
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / f"{name}.yaml").write_text(yaml.safe_dump(cfg))


@dataclass
class Standalone:
    """A running `airflow standalone` and an authenticated REST client for it."""

    proc: subprocess.Popen
    base_url: str
    home: Path
    config_dir: Path
    log_path: Path
    token: str = ""
    env: dict[str, str] = field(default_factory=dict)
    dag_ids: tuple[str, ...] = ()

    def start(self) -> None:
        """Start every component (again, after `stop`: same home, database, port and token)."""
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen([RETRAINER, *README_AIRFLOW_COMMANDS[-1]], env=self.env, cwd=self.home,
                                         stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.token = ""  # a fresh one from the new API server
        _wait_ready(self, list(self.dag_ids))

    def stop(self) -> None:
        """Stop the scheduler, triggerer, workers, DAG processor and API server (the whole process group)."""
        _stop_group(self.proc)

    def config_path(self, model: str) -> Path:
        return self.config_dir / f"{model}.yaml"

    def model_home(self, model: str) -> Path:
        """Where `model`'s data, runs, cache, registry database and store live."""
        return self.home / model

    def set_step_delay(self, model: str, seconds: float) -> None:
        """From their next step on, the ranks training `model` sleep `seconds` after each (tests/hooks)."""
        set_step_delay(Path(self.env["HOOK_STEP_DELAY_DIR"]), model, seconds)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def token_for(self, user: str) -> str:
        """A bearer token of one of the standalone's users (tests/services.py AIRFLOW_TEST_USERS), logged in with
        the password Airflow generated for them, as that person would."""
        if user == "admin":
            return self.token
        password = json.loads((self.home / "airflow" / PASSWORD_FILE).read_text())[user]
        with httpx.Client(base_url=self.base_url, timeout=60) as c:
            resp = c.post("/auth/token", json={"username": user, "password": password})
        assert resp.status_code in (200, 201), resp.text
        return resp.json()["access_token"]

    def client(self, authenticated: bool = True, user: str = "admin") -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token_for(user)}"} if authenticated else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def trigger(self, dag_id: str, conf: dict[str, Any], user: str = "admin") -> httpx.Response:
        with self.client(user=user) as c:
            return c.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                run = c.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").raise_for_status().json()
                if run["state"] in ("success", "failed"):
                    return run
                assert self.proc.poll() is None, f"airflow standalone died:\n{self.log_tail()}"
                time.sleep(0.5)
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
            time.sleep(0.5)
        raise AssertionError(f"no new {dag_id} run in {timeout}s:\n{self.log_tail()}")

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        with self.client() as c:
            tis = c.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").raise_for_status().json()
        return {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        with self.client() as c:
            url = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
            return c.get(url, params={"full_content": True}).raise_for_status().text

    def tries_logs(self, dag_id: str, run_id: str, task_id: str, tail_chars: int = 3000) -> str:
        """Every try's log tail, for a failure message (a try without a log says so), and the standalone's."""
        with self.client() as c:
            ti = c.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}").raise_for_status().json()
            parts = [f"{task_id}: state {ti['state']}, try {ti['try_number']}"]
            for attempt in range(1, ti["try_number"] + 1):
                url = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{attempt}"
                resp = c.get(url, params={"full_content": True})
                text = resp.text[-tail_chars:] if resp.status_code == 200 else f"(no log: HTTP {resp.status_code})"
                parts.append(f"--- try {attempt} ---\n{text}")
        return "\n".join([*parts, "--- standalone ---", self.log_tail(120)])

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(sa: Standalone, dag_ids: list[str], timeout: float = 300) -> None:
    """API up, admin password generated, token issued, and our DAGs parsed."""
    deadline = time.monotonic() + timeout
    password_file = sa.home / "airflow" / PASSWORD_FILE
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


SITECUSTOMIZE = '''"""Test-only: every Python process of this standalone installs the launcher-side test hooks."""
from tests.hooks import install

install()
'''


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules using the standalone run after the package's others (stable, file order kept): the
    standalone starts at their first test and idles beside none of the rest."""
    package = Path(__file__).parent
    ours = [i for i, item in enumerate(items) if package in item.path.parents]
    if ours:
        block = [items[i] for i in ours]
        block.sort(key=lambda item: "standalone" in item.fixturenames)
        for i, item in zip(ours, block, strict=True):
            items[i] = item


@pytest.fixture(scope="package")
def standalone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """One standalone for every selected module's `TENANT`. Without the session's Slurm (missing: skipped, or
    failed under CI) the tenants that train on it are left out; their own tests meet the same refusal."""
    modules = {item.module for item in request.session.items if "standalone" in item.fixturenames}
    tenants = []
    for module in sorted(modules, key=lambda m: m.__name__):
        assert isinstance(getattr(module, "TENANT", None), Tenant), f"{module.__name__} declares no TENANT"
        tenants.append(module.TENANT)
    env: dict[str, str] = {}
    if any(t.slurm for t in tenants):
        try:
            env.update(request.getfixturevalue("slurm_cluster").env)
        except (pytest.skip.Exception, pytest.fail.Exception):
            tenants = [t for t in tenants if not t.slurm]
    home = tmp_path_factory.mktemp("standalone")
    with running_standalone(home, tenants, env) as sa:
        yield sa


@contextlib.contextmanager
def running_standalone(home: Path, tenants: list[Tenant], env: dict[str, str]) -> Iterator[Standalone]:
    """A real `airflow standalone` for the tenants' models (configs and data written first), started by the
    README's lines (registries: each model's SQLite database, created by its first use as the README's
    embedded default is; the tenants' pools beside the README's, created the same way), `env` added to the
    harness's; stopped, whole process group, on exit."""
    from tasks.data.synthetic import make_data

    config_dir = home / "configs"
    pools: dict[str, int] = {}
    for tenant in tenants:
        for name, mutate in tenant.models.items():
            assert not (config_dir / f"{name}.yaml").exists(), f"two tenants name the model {name}"
            write_test_config(config_dir, home / name, name, mutate)
            make_data(str(home / name / "store" / "data"), name="tiny-llama", n_train_shards=2,
                      tokens_per_shard=16384)
        for name, slots in tenant.pools.items():
            assert pools.setdefault(name, slots) == slots, f"tenants disagree on pool {name}"
    python_path = [str(ROOT), os.environ.get("PYTHONPATH")]
    hook_env: dict[str, str] = {}
    if any(t.hooks for t in tenants):  # every process imports tests.hooks: the checkout is on the path too
        site = home / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        python_path.insert(0, str(site))
        hook_env["HOOK_STEP_DELAY_DIR"] = str(home / "step-delays")
        (home / "step-delays").mkdir()
    port = free_port()
    env = {
        **_bare_environment(),
        # What the README names for a user to set:
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": AIRFLOW_TEST_USERS,  # people of each role (README: who may do what)
        "AIRFLOW__API__PORT": str(port),  # and not AIRFLOW__API__BASE_URL: the wrapper derives it
        "RETRAINER_CONFIG_DIR": str(config_dir),
        "RETRAINER_HOME": str(home / "retrainer"),
        # README: Lineage, with OpenLineage's file transport in place of a backend (tests read the events).
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(home / LINEAGE_EVENTS),
                                                       "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "retrainer-test",
        # Harness tuning for 2 busy cores:
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__API__WORKERS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in python_path if p),
        **env,
        **hook_env,
    }
    dag_ids = tuple(dict.fromkeys(d for t in tenants for d in t.dag_ids))
    sa = Standalone(proc=None, base_url=f"http://127.0.0.1:{port}", home=home,  # type: ignore[arg-type]
                    config_dir=config_dir, log_path=home / "standalone.log", env=env, dag_ids=dag_ids)
    migrate, readme_pool, _ = README_AIRFLOW_COMMANDS
    # The README's pool line, and the tenants' pools in the same form (a deferred training holds its GPUs).
    pool_lines = [readme_pool, *([*readme_pool[:3], name, str(slots), *readme_pool[5:]]
                                 for name, slots in pools.items())]
    for command in (migrate, *pool_lines):
        done = subprocess.run([RETRAINER, *command], env=env, cwd=home, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"retrainer {' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    try:
        sa.start()
        yield sa
    finally:
        if sa.proc is not None:
            _stop_group(sa.proc)


def _bare_environment() -> dict[str, str]:
    """This process's environment without anything the README's instructions must provide themselves: no
    AIRFLOW_*/RETRAINER_* variable (this test session sets several) and not the venv's bin on PATH."""
    venv_bin = Path(sys.executable).parent.resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RETRAINER"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != venv_bin)
    return env


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
