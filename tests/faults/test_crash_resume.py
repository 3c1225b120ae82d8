"""SIGKILL the task process mid-training and inside a checkpoint commit: the re-run resumes from the
last complete checkpoint (not step 0), and the finished run publishes exactly one version."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from tasks.data.synthetic import make_data
from tasks.train.checkpoint import ckpt_root, read_latest
from tests.faults.conftest import (
    Job,
    TaskProcess,
    driver,
    finished_steps,
    processes_mentioning,
    read_json,
    reap,
    run_task,
    task_env,
)
from tests.services import require

pytestmark = pytest.mark.multiproc


def test_sigkill_inside_checkpoint_commit_then_rerun_resumes_and_publishes_once(
    sqlite_job: Job, tmp_path: Path, no_leftovers: None
) -> None:
    job, state = sqlite_job, tmp_path / "state"
    # Last week's run finished in the same output dir; this week's data is new. The retry below must
    # resume this week's own checkpoint, never last week's finished one (that trained zero steps once).
    last_week = tmp_path / "last-week"
    rc, out = run_task(driver(job, last_week, "plan", "warm", "train"), tmp_path / "last-week.log")
    assert rc == 0, out[-2000:]
    make_data(str(tmp_path / "store" / "data"), name="tiny-llama", seed=99, n_train_shards=2, tokens_per_shard=16384)
    rc, out = run_task(driver(job, state, "plan", "warm"), tmp_path / "warm.log")
    assert rc == 0, out[-2000:]
    assert job.run_dir(state) != job.run_dir(last_week)
    root = ckpt_root(job.run_dir(state))

    # Step 4's checkpoint files are written, its commit is paused: kill the task process right there.
    env = task_env(HOOK_CKPT_DELAY="4:120")
    task = TaskProcess(driver(job, state, "train"), tmp_path / "train-1.log", env)
    task.wait_for(lambda: "pausing 120 s inside the commit of step 4" in task.text(), "the step-4 commit")
    task.sigkill()
    reap(processes_mentioning(str(tmp_path)))  # ranks a SIGKILLed launcher may leave (see the orphan test)
    assert read_latest(root) == "step-000002"  # the pointer still names the last complete checkpoint
    assert (root / "step-000002" / "COMPLETE").is_file()
    assert not (root / "step-000004").exists()
    assert not (state / "train.json").exists()

    # Re-run (a retry of the train task): it resumes at step 2 and runs to the end.
    rc, out = run_task(driver(job, state, "train"), tmp_path / "train-2.log")
    assert rc == 0, out[-3000:]
    summary = read_json(state / "train.json")
    assert summary["resumed_from_step"] == 2
    assert summary["checkpoint_tag"] == "step-000006"
    assert len(summary["losses"]) == 6  # the two steps before the crash + the four after it
    assert summary["checkpoint_dir"].startswith(str(job.run_dir(state)))
    assert read_latest(ckpt_root(job.run_dir(last_week))) == "step-000006"  # last week's run untouched
    assert read_latest(root) == "step-000006"
    assert not list(root.glob("tmp-*"))  # the interrupted commit was swept, never loaded
    assert "removing incomplete checkpoint" in out

    require(importlib.util.find_spec("tasks.evaluate") is not None, "tasks.evaluate (the evaluate stage)")
    for attempt in (1, 2):  # the publish half of the DAG, then a full re-run of it: still one version
        rc, out = run_task(driver(job, state, "evaluate", "gate", "publish"), tmp_path / f"publish-{attempt}.log")
        assert rc == 0, out[-3000:]
    registry = job.registry()
    assert [v.version for v in registry.list_versions("tiny-llama")] == [1]
    assert registry.live_version("tiny-llama", "production").version == 1
    assert [(h.from_version, h.to_version) for h in registry.history("tiny-llama", "production")] == [(None, 1)]


def test_sigkill_of_the_task_process_leaves_no_rank_running(
    sqlite_job: Job, tmp_path: Path, no_leftovers: None
) -> None:
    """An OOM-killed or lost Airflow task must not leave ranks training (they would race the retry)."""
    job, state = sqlite_job, tmp_path / "state"
    rc, out = run_task(driver(job, state, "warm"), tmp_path / "warm.log")
    assert rc == 0, out[-2000:]
    task = TaskProcess(driver(job, state, "train"), tmp_path / "train.log",
                       task_env(HOOK_STEP_DELAY_S="5"))
    task.wait_for(lambda: finished_steps(job.run_dir(state)) >= 1, "step 1")
    task.sigkill()
    time.sleep(3)  # give a parent-death signal time to land
    assert processes_mentioning(str(tmp_path)) == []
