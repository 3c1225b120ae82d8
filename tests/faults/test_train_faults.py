"""Training faults: NaN at step k, a duplicate trigger while a run trains, a full checkpoint disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tasks.models.weights import weights_digest
from tasks.train.checkpoint import ckpt_root, read_latest
from tests.faults.conftest import (
    Job,
    TaskProcess,
    Trained,
    driver,
    make_job,
    metrics_file,
    read_json,
    run_task,
    task_env,
)
from tests.hooks import set_step_delay
from tests.services import require

pytestmark = pytest.mark.multiproc


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real, tiny filesystem at `path` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode == 0
    require(mounted, f"a {size} tmpfs mount (root and mount -t tmpfs)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(path: Path) -> None:
    """Write zeros until the filesystem is full (unbuffered, so closing cannot fail)."""
    with contextlib.suppress(OSError), path.open("wb", buffering=0) as fh:
        while True:
            fh.write(b"\0" * (1 << 20))


def test_nan_at_step_k_fails_publishes_nothing_alias_unchanged(
    trained: Trained, tmp_path: Path, no_leftovers: None
) -> None:
    job = trained.job_for(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    state = trained.state_for(tmp_path)
    rc, out = run_task([*driver(job, state, "publish"), "--metrics", str(metrics_file(tmp_path, state))],
                       tmp_path / "seed.log")
    assert rc == 0, out[-3000:]  # v1 is live before the bad run
    job.update("train", steps=6)  # a new experiment (6 steps); it goes NaN at step 5

    rc, out = run_task(driver(job, state, "train", "evaluate", "gate", "publish"), tmp_path / "nan.log",
                       task_env(HOOK_NAN_AT_STEP="5"))
    assert rc == 1, out[-3000:]
    assert "non-finite loss at step 5" in out
    assert read_json(state / "train.json")["steps"] == 4  # the seed's summary: nothing new was recorded
    registry = job.registry()
    assert [v.version for v in registry.list_versions("tiny-llama")] == [1]
    assert registry.live_version("tiny-llama", "production").version == 1
    assert [(h.from_version, h.to_version) for h in registry.history("tiny-llama")] == [(None, 1)]
    assert not (job.run_dir(state) / "summary.json").exists()
    assert read_latest(ckpt_root(job.run_dir(state))) == "step-000004"  # the last good checkpoint stays


def test_duplicate_trigger_is_refused_by_the_lock_naming_the_holder(
    tmp_path: Path, pg_url: str, no_leftovers: None
) -> None:
    job = make_job(tmp_path, pg_url)
    rc, out = run_task(driver(job, tmp_path / "a", "warm"), tmp_path / "warm.log")
    assert rc == 0, out[-2000:]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "warm.json").write_text((tmp_path / "a" / "warm.json").read_text())

    delays = tmp_path / "delays"  # each rank's pause after a step, read again as it sleeps (tests/hooks)
    delays.mkdir()
    set_step_delay(delays, job.cfg().name, 3)
    first = TaskProcess(driver(job, tmp_path / "a", "train"), tmp_path / "first.log",
                        task_env(HOOK_STEP_DELAY_DIR=str(delays)))
    first.wait_for(lambda: "checkpoint committed" in first.text(), "the first run's first checkpoint")
    set_step_delay(delays, job.cfg().name, 600)  # the holder stays until killed below, however slow the box
    root = ckpt_root(job.run_dir(tmp_path / "a"))
    m = job.cfg().model
    before = {p.name: weights_digest(p, m) for p in root.glob("step-*")}

    rc, out = run_task(driver(job, tmp_path / "b", "train"), tmp_path / "second.log")
    assert rc == 1, out[-3000:]
    assert "is already being trained by fault-suite driver a" in out
    assert "launching" not in out  # refused before a single rank started
    assert not (tmp_path / "b" / "train.json").exists()
    assert first.proc.poll() is None  # the holder carries on
    for name, digest in before.items():
        assert weights_digest(root / name, m) == digest
    first.sigkill()


def test_checkpoint_disk_full_fails_clearly_previous_checkpoint_intact(
    sqlite_job: Job, tmp_path: Path, no_leftovers: None
) -> None:
    job, state = sqlite_job, tmp_path / "state"
    rc, out = run_task(driver(job, state, "warm"), tmp_path / "warm.log")
    assert rc == 0, out[-2000:]
    root = ckpt_root(job.run_dir(state))
    with small_tmpfs(root, "64m"):
        # Once step 2 is committed, fill what is left of the disk: the step-4 checkpoint cannot fit.
        task = TaskProcess(driver(job, state, "train"), tmp_path / "train.log",
                           task_env(HOOK_STEP_DELAY_S="1"))
        task.wait_for(lambda: "ckpt/step-000002" in task.text(), "the step-2 commit")
        fill(root / "filler")
        rc, out = task.finish(timeout=600), task.text()
        assert rc != 0, out[-3000:]
        # The background save names the checkpoint, the rank and the path; torch.save on a full disk still
        # gives no ENOSPC (see the README's Reliability table).
        assert "retrainer: error: training of tiny-llama failed" in out
        assert "checkpoint step-000004 write failed on rank 0: writing " in out
        assert read_latest(root) == "step-000002"
        good = root / "step-000002"
        assert (good / "COMPLETE").is_file()
        assert weights_digest(good, job.cfg().model)  # every tensor of it loads
        assert not (root / "step-000004").exists()  # nothing half-written under a final name
        assert not (state / "train.json").exists()
