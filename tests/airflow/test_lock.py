"""Experiment lock with real processes: exactly one of two concurrent runs trains; a killed holder
frees the lock at once. Runs on PostgreSQL (advisory lock) and SQLite (file lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import REPO_ROOT
from tasks.base.errors import LockHeldError
from tasks.base.lock import experiment_lock
from tasks.config.util import sha256_json

HOLDER = Path(__file__).with_name("lock_holder.py")
ROOT = REPO_ROOT


def _spawn(registry_url: str, key: str, work: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(HOLDER), registry_url, key, str(work), name], env=env)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the lock holder")
        time.sleep(0.02)


def _take_within(registry_url: str, key: str, seconds: float) -> bool:
    """Take and release the lock, retrying while the dead holder's session is torn down."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with experiment_lock(registry_url, key, "pytest-after-kill"):
                return True
        except LockHeldError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def test_two_concurrent_runs_exactly_one_trains_and_a_killed_holder_frees_the_lock(
    registry_url: str, tmp_path: Path
) -> None:
    key = sha256_json({"experiment": tmp_path.name})
    procs = {name: _spawn(registry_url, key, tmp_path, name) for name in ("a", "b")}
    try:
        (tmp_path / "go").write_text("")  # both race for the lock from here
        _wait_for(lambda: len(list(tmp_path.glob("*.trained"))) + len(list(tmp_path.glob("*.refused"))) == 2)
        trained = sorted(p.stem for p in tmp_path.glob("*.trained"))
        refused = sorted(p.stem for p in tmp_path.glob("*.refused"))
        assert len(trained) == 1 and len(refused) == 1, (trained, refused)
        winner, loser = trained[0], refused[0]
        assert procs[loser].wait(timeout=30) == 3
        message = (tmp_path / f"{loser}.refused").read_text()
        assert f"holder-{winner}" in message, message
        assert key[:12] in message

        # A third contender (this process) is refused too, naming the live holder.
        with pytest.raises(LockHeldError, match=f"holder-{winner}"), experiment_lock(registry_url, key, "pytest"):
            pass

        # SIGKILL the holder: no cleanup code runs, yet the lock frees with it (the file lock as the
        # process is reaped; the advisory lock as soon as its server backend sees the socket close).
        procs[winner].send_signal(signal.SIGKILL)
        assert procs[winner].wait(timeout=30) == -signal.SIGKILL
        assert _take_within(registry_url, key, seconds=10.0), "lock still held 10 s after its holder died"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_different_experiments_do_not_block_each_other(registry_url: str) -> None:
    key_a, key_b = sha256_json({"e": "a"}), sha256_json({"e": "b"})
    with (
        experiment_lock(registry_url, key_a, "run-a"),
        experiment_lock(registry_url, key_b, "run-b"),
        pytest.raises(LockHeldError, match="run-a"),
        experiment_lock(registry_url, key_a, "run-a2"),
    ):
        pass
    # Released on normal exit: taking it again succeeds.
    with experiment_lock(registry_url, key_a, "run-a3"):
        pass
