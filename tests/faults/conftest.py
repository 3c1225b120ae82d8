"""Helpers for the fault-injection suite: a shrunk job, the real `retrainer` CLI as the task process,
and the bookkeeping to kill it at a chosen moment and find anything it left running."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks import REPO_ROOT
from tests.dags.test_lifecycle_e2e import write_config

ROOT = REPO_ROOT
DRIVER = [sys.executable, "-m", "tests.faults.driver"]


def task_env(**extra: str) -> dict[str, str]:
    """The task process's environment: one OpenMP thread per process (2 shared cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Job:
    """One shrunk job: its config file, folders and registry."""

    tmp: Path
    config: Path
    registry_url: str

    @property
    def data(self) -> dict[str, Any]:
        return yaml.safe_load(self.config.read_text())

    def update(self, section: str, **values: Any) -> None:
        cfg = self.data
        cfg[section].update(values)
        self.config.write_text(yaml.safe_dump(cfg))

    def cfg(self):
        from tasks.models.resolve import load_config

        return load_config(self.config)

    def run_dir(self, state: Path) -> Path:
        """The run directory of the run the driver planned in `state`."""
        from tasks.runs.identity import RunIdentity

        return RunIdentity.from_dict(read_json(state / "plan.json")["run"]).run_dir(self.cfg())

    def registry(self):
        from tasks.registry import Registry

        return Registry(self.registry_url)


def make_job(tmp: Path, registry_url: str, *, steps: int = 6, checkpoint_every: int = 2) -> Job:
    """The e2e test's shrunk demo config (imported, not copied) + a small synthetic dataset + its registry,
    migrated (as `retrainer db upgrade` does before any task runs)."""
    from tasks.data.synthetic import make_data
    from tasks.registry import upgrade

    upgrade(registry_url)
    config = write_config(tmp, registry_url)
    job = Job(tmp=tmp, config=config, registry_url=registry_url)
    job.update("train", steps=steps, checkpoint_every=checkpoint_every, keep_last=3)
    make_data(str(tmp / "store" / "data"), name="tiny-llama", n_train_shards=2, tokens_per_shard=16384)
    return job


@pytest.fixture
def sqlite_job(tmp_path: Path) -> Job:
    return make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")


class TaskProcess:
    """A driver process standing in for an Airflow task process (see driver.py); output goes to a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen([*DRIVER, *argv], stdout=self._fh, stderr=subprocess.STDOUT,
                                     env=env or task_env(), cwd=ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"task exited ({self.proc.returncode}) before {what}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.text()[-3000:]}")
            time.sleep(0.05)

    def sigkill(self) -> None:
        """SIGKILL the task process only, like an OOM kill or a lost worker: no handler can run."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._fh.close()

    def finish(self, timeout: float = 600.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()
        return rc


def run_task(argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 600.0
             ) -> tuple[int, str]:
    task = TaskProcess(argv, log, env)
    rc = task.finish(timeout)
    return rc, task.text()


def processes_mentioning(marker: str) -> list[int]:
    """Live pids whose command line mentions `marker` (a test's private tmp path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def reap(pids: list[int]) -> None:
    """SIGKILL processes this test started (found by its private path), by pid."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.05)


@pytest.fixture
def no_leftovers(tmp_path: Path) -> Iterator[None]:
    """Whatever a test started (ranks included) is gone when it ends, even on failure."""
    yield
    reap(processes_mentioning(str(tmp_path)))


def finished_steps(run_dir: Path) -> int:
    """The last finished step the run's status file reports (0 before the first)."""
    from tasks.base.job_status import STATUS_FILE, read_status

    status = read_status(run_dir / STATUS_FILE)
    return status.step if status is not None and status.state == "training" else 0


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def driver(job: Job, state: Path, *stages: str) -> list[str]:
    return [str(job.config), str(state), *stages]


@dataclass
class Trained:
    """A finished, shared training run: warm + train outputs a publish can be re-run against."""

    job: Job
    state: Path

    def job_for(self, tmp: Path, registry_url: str) -> Job:
        """The same experiment (same run dir, same checkpoints) publishing to another registry (migrated)."""
        from tasks.registry import upgrade

        upgrade(registry_url)
        cfg = self.job.data
        cfg["publish"]["registry_url"] = registry_url
        config = tmp / "job.yaml"
        config.write_text(yaml.safe_dump(cfg))
        return Job(tmp=tmp, config=config, registry_url=registry_url)

    def state_for(self, tmp: Path) -> Path:
        """A private copy of the stage outputs (warm.json, train.json) for one test."""
        state = tmp / "state"
        state.mkdir()
        for name in ("plan", "warm", "train"):
            (state / f"{name}.json").write_text((self.state / f"{name}.json").read_text())
        return state

    def run_dir(self) -> Path:
        return self.job.run_dir(self.state)


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """One real training run (torchrun, 2 ranks, 4 steps), shared by the publish and input tests."""
    tmp = tmp_path_factory.mktemp("trained")
    job = make_job(tmp, f"sqlite:///{tmp / 'registry.db'}", steps=4, checkpoint_every=2)
    state = tmp / "state"
    rc, out = run_task(driver(job, state, "plan", "warm", "train"), tmp / "train.log")
    assert rc == 0, out[-3000:]
    return Trained(job=job, state=state)


def metrics_file(tmp: Path, trained_state: Path) -> Path:
    """Publish-only tests record the run's final training loss as the version's metrics (an evaluate stage's
    result, in its XCom's JSON form, without scoring anything)."""
    summary = read_json(trained_state / "train.json")
    loss = summary["final_loss"]
    path = tmp / "metrics.json"
    path.write_text(json.dumps({
        "metrics": {"heldout.loss": loss}, "live": None, "suite_hash": "0" * 64, "suites": [], "loss": loss,
        "perplexity": math.exp(loss), "tokens": 0, "batches": 0, "batch_size": 0,
        "checkpoint_dir": summary["checkpoint_dir"], "checkpoint_tag": summary["checkpoint_tag"],
        "step": summary["steps"], "experiment_key": summary["experiment_key"]}))
    return path
