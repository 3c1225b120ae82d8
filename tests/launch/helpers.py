"""Helpers for launcher tests: run a launcher as its own process, find a run's training processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from tasks import REPO_ROOT
from tasks.base.spawn import FORKED_RANK_NAME
from tasks.config.schema import JobConfig

ROOT = REPO_ROOT


def spawn_launcher(cfg: JobConfig, dataset_dir: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`retrainer train` in a separate process, as an Airflow task would run it, with the test hooks
    installed (tests/hooks: `HOOK_*` variables in `env` switch them on); `env` adds to its environment."""
    config = Path(cfg.train.output_dir).parent / f"{Path(cfg.train.output_dir).name}.config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "tests.hooks.cli", "train", str(config), "--dataset-dir",
                                 str(dataset_dir)],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=fh,
                                stderr=subprocess.STDOUT)


@contextmanager
def launched(cfg: JobConfig, dataset_dir: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`spawn_launcher`, killed and reaped on the way out if the test left it running."""
    launcher = spawn_launcher(cfg, dataset_dir, env, log)
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def wait_for_step(output_dir: str | Path, step: int, proc: subprocess.Popen[bytes] | None = None,
                  timeout_s: float = 240.0) -> None:
    """Block until the run's status file says `step` finished."""
    from tasks.base.job_status import STATUS_FILE, read_status

    path = Path(output_dir) / STATUS_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) before step {step}")
        status = read_status(path)
        if status is not None and status.state in ("training", "finished") and status.step >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {path} after {timeout_s}s")


def is_rank(proc: psutil.Process) -> bool:
    """A training rank itself (`-m tasks.train.worker` or the hooked `tests.hooks.worker`), not its spawner or agent:
    a rank the spawner forked (a node without GPUs, tasks/base/spawn.py) has its spawner's command line and is
    named `rank N`; one it started as a new process names the worker module itself."""
    cmdline = set(proc.cmdline())
    if not {"tasks.train.worker", "tests.hooks.worker"} & cmdline:
        return False
    if proc.name().startswith(FORKED_RANK_NAME):
        return True
    return not {"tasks.base.spawn", "tasks.launch.agent"} & cmdline


def training_processes(output_dir: str | Path) -> list[psutil.Process]:
    """Live processes (torchrun, ranks, agents) whose command line names this run's output dir."""
    needle = str(output_dir).rstrip("/") + "/"
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and needle in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def source_line(path: str, text: str) -> str:
    """`path:N`, N the one line of the repository file `path` that holds `text`: where an error names it."""
    (number,) = [i for i, line in enumerate((ROOT / path).read_text().splitlines(), 1) if text in line]
    return f"{path}:{number}"
