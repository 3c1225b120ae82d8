"""A process killed while loading DeepSpeed's CPU comm op leaves torch's lock file behind; the next load
(a rank's start, setup's prebuild) must go on instead of waiting for it forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks.base.comm_ops import EXTENSIONS_VAR, default_extensions_dir


def test_a_lock_left_by_a_killed_loader_does_not_wedge_the_next_load() -> None:
    op_dir = Path(os.environ.get(EXTENSIONS_VAR) or default_extensions_dir()) / "deepspeed_shm_comm"
    op_dir.mkdir(parents=True, exist_ok=True)
    stale = op_dir / "lock"
    stale.touch()  # what a loader SIGKILLed inside torch's load leaves
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from tasks.base.comm_ops import load_shm_op; print(load_shm_op())"],
            capture_output=True, text=True, timeout=180, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    finally:
        stale.unlink(missing_ok=True)  # never leave the wedge for the rest of the suite
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
    assert "a process died while loading deepspeed_shm_comm" in done.stderr


def test_a_process_without_the_venv_on_its_path_loads_the_built_op_without_rebuilding_it() -> None:
    """An Airflow worker started without the venv's bin on PATH finds another ninja first (Debian's, where
    installed): the op built by a CLI run must still load as built, not be compiled again by every rank."""
    op = Path(os.environ.get(EXTENSIONS_VAR) or default_extensions_dir()) / "deepspeed_shm_comm" / \
        "deepspeed_shm_comm.so"
    venv_bin = str(Path(sys.executable).parent)
    system_path = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())

    def load(path: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", "from tasks.base.comm_ops import load_shm_op; print(load_shm_op())"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "DS_ACCELERATOR": "cpu", "PATH": path})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "True"

    load(os.pathsep.join([venv_bin, system_path]))  # as a CLI run in the activated venv
    built = op.stat().st_mtime_ns
    load(system_path)  # as the Airflow worker
    load(os.pathsep.join([venv_bin, system_path]))
    assert op.stat().st_mtime_ns == built, "the op was compiled again"
