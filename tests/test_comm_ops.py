"""A process killed while loading DeepSpeed's CPU comm op leaves torch's lock file behind; the next load
(a rank's start, setup's prebuild) must go on instead of waiting for it forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks.comm_ops import EXTENSIONS_VAR, default_extensions_dir


def test_a_lock_left_by_a_killed_loader_does_not_wedge_the_next_load() -> None:
    op_dir = Path(os.environ.get(EXTENSIONS_VAR) or default_extensions_dir()) / "deepspeed_shm_comm"
    op_dir.mkdir(parents=True, exist_ok=True)
    stale = op_dir / "lock"
    stale.touch()  # what a loader SIGKILLed inside torch's load leaves
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from tasks.comm_ops import load_shm_op; print(load_shm_op())"],
            capture_output=True, text=True, timeout=180, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    finally:
        stale.unlink(missing_ok=True)  # never leave the wedge for the rest of the suite
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
    assert "a process died while loading deepspeed_shm_comm" in done.stderr
