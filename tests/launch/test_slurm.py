"""The slurm launcher on a real single-node Slurm (munged + slurmctld + slurmd from the fixture)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from tasks.launch import LaunchOptions, get_launcher
from tests.hooks import set_step_delay
from tests.launch.conftest import SlurmCluster, tiny_config, write_dataset
from tests.launch.helpers import launched, source_line, training_processes, wait_for_step

pytestmark = pytest.mark.multiproc


def job_processes(job_id: str) -> list[int]:
    """Live processes that belong to a Slurm job (Slurm puts SLURM_JOB_ID in every task's environment)."""
    needle = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


def test_sbatch_job_trains_and_records_its_id(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.partition": "test",
                                 "cluster.slurm.time_limit": "00:10:00"}, out="slurm")
    summary = get_launcher(cfg, env=slurm_cluster.env).run(cfg, dataset)

    out = Path(cfg.train.output_dir)
    job_id = (out / "slurm-job-id").read_text().strip()
    assert summary["losses"] and len(summary["losses"]) == cfg.train.steps
    assert list(Path(summary["checkpoint_dir"]).glob("layer_*-model_states.pt"))
    assert "#SBATCH --partition=test" in (out / "slurm-job.sbatch").read_text()
    job = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job
    assert "step 5/5 (100%)" in (out / f"slurm-{job_id}.out").read_text()  # the ranks' log reaches the output
    assert job_processes(job_id) == []


def test_killing_the_launcher_scancels_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "train.steps": 200,
                                 "cluster.slurm.time_limit": "00:10:00"}, out="slurm")
    env = {**slurm_cluster.env, "HOOK_STEP_DELAY_S": "0.3"}
    with launched(cfg, dataset, env, tmp_path / "launcher.log") as launcher:
        wait_for_step(cfg.train.output_dir, 2, launcher)
        job_id = (Path(cfg.train.output_dir) / "slurm-job-id").read_text().strip()
        assert len(job_processes(job_id)) >= 2  # torchrun + its rank (at least), really running under Slurm
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=180)
    log = (tmp_path / "launcher.log").read_text()
    assert rc == 143, log[-3000:]
    assert f"scancel {job_id}" in log
    assert "JobState=CANCELLED" in slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert job_processes(job_id) == []
    assert training_processes(cfg.train.output_dir) == []


def test_sigkilled_launcher_then_retry_cancels_the_old_job_first_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A SIGKILLed Airflow task runs no cleanup: its Slurm job would train on to its time limit next to the
    retry. The retry finds the job of the same run by its name, cancels it, says so, then resumes."""
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "train.steps": 12, "train.checkpoint_every": 2,
                                 "cluster.slurm.time_limit": "00:10:00"}, out="slurm")
    out = Path(cfg.train.output_dir)
    delays = tmp_path / "step-delays"
    delays.mkdir()
    set_step_delay(delays, cfg.name, 0.5)
    env = {**slurm_cluster.env, "HOOK_STEP_DELAY_DIR": str(delays)}
    with launched(cfg, dataset, env, tmp_path / "first.log") as first:
        wait_for_step(out, 4, first)
        set_step_delay(delays, cfg.name, 600)  # the orphan holds after its next step: it cannot end before the retry
        old_job = (out / "slurm-job-id").read_text().strip()
        first.kill()  # SIGKILL: no handler runs, nothing is cancelled
        first.wait()
    assert job_processes(old_job), "the orphaned Slurm job should still be running"

    with launched(cfg, dataset, slurm_cluster.env, tmp_path / "retry.log") as retry:
        rc = retry.wait(timeout=300)
    log = (tmp_path / "retry.log").read_text()
    assert rc == 0, log[-3000:]
    assert f"job {old_job} (retrainer-{cfg.name}-" in log and "cancelling it before launching" in log
    assert "JobState=CANCELLED" in slurm_cluster.run("scontrol", "show", "job", "-o", old_job).stdout
    assert job_processes(old_job) == []
    new_job = (out / "slurm-job-id").read_text().strip()
    assert new_job != old_job
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] and summary["resumed_from_step"] >= 4
    assert len(summary["losses"]) == 12


def test_staging_step_warms_each_node_in_the_allocation_and_refuses_other_data(slurm_cluster: SlurmCluster,
                                                                              tmp_path: Path) -> None:
    from tasks.base.errors import TrainingFailedError
    from tasks.data.synthetic import make_data
    from tasks.data.warm import remote_manifest_hash, warm_for_config
    from tasks.runs.identity import identity, scratch

    overrides = {"cluster.launcher": "slurm", "cluster.partition": "test", "cluster.slurm.time_limit": "00:10:00"}
    cfg = tiny_config(tmp_path, overrides, out="staged")
    make_data(cfg.data.source_url, name=cfg.name, seed=5, tokens_per_shard=16384)
    run = identity(cfg, remote_manifest_hash(cfg.data.source_url), scratch(cfg))
    here = warm_for_config(cfg)  # the Airflow worker's own warm (planning, evaluation)
    summary = get_launcher(cfg, env=slurm_cluster.env).run(cfg, here.dataset_dir, run=run,
                                                           options=LaunchOptions(node_warm=True))

    out = Path(cfg.train.output_dir)
    script = (out / "slurm-job.sbatch").read_text()
    order = [script.index(s) for s in ("-m tasks.inputs.node", "unset RETRAINER_WARM_SPEC", "-m tasks.base.spawn")]
    assert order == sorted(order)
    assert run.data_manifest_hash not in script  # the spec travels in sbatch's environment, not in the file
    (node,) = summary["nodes"]
    assert node["manifest_hash"] == run.data_manifest_hash and node["files"] > 0
    assert (out / "warm" / f"{node['node']}.json").is_file()
    assert len(summary["losses"]) == cfg.train.steps

    # New data lands after the run was planned: the staging step refuses, naming the node; no rank starts.
    make_data(cfg.data.source_url, name=cfg.name, seed=6, tokens_per_shard=16384)
    late = tiny_config(tmp_path, overrides, out="late")
    with pytest.raises(TrainingFailedError, match=rf"node {node['node']}: the dataset at .* verified as manifest"):
        get_launcher(late, env=slurm_cluster.env).run(late, here.dataset_dir, run=run,
                                                      options=LaunchOptions(node_warm=True))
    job_id = (Path(late.train.output_dir) / "slurm-job-id").read_text().strip()
    assert "step 1/" not in (Path(late.train.output_dir) / f"slurm-{job_id}.out").read_text()


def test_evaluation_runs_as_a_slurm_job(slurm_cluster: SlurmCluster, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.evaluate import evaluate
    from tests.checkpoints import reference_checkpoint

    cfg = tiny_config(tmp_path, {"model.family": "llama", "cluster.launcher": "slurm", "cluster.partition": "test",
                                 "cluster.slurm.time_limit": "00:10:00"}, out="slurm")
    run, ckpt = reference_checkpoint(cfg)
    local = evaluate(cfg.with_overrides({"cluster.launcher": "local"}), run, ckpt, cfg.data.source_url)
    for name, value in slurm_cluster.env.items():
        monkeypatch.setenv(name, value)
    under_slurm = evaluate(cfg, run, ckpt, cfg.data.source_url)
    assert under_slurm.metrics == pytest.approx(local.metrics, rel=1e-9)
    (script,) = (ckpt.parent.parent / "eval").glob("*/slurm-job.sbatch")
    assert "tasks.evaluate.worker" in script.read_text() and "tasks.train.worker" not in script.read_text()
    job_id = (script.parent / "slurm-job-id").read_text().strip()
    job = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "JobState=COMPLETED" in job and job_processes(job_id) == []
    # Named for the evaluation in its eval/<id> directory, not as the run's training job (a retry of the
    # training would cancel that one), under the run's own identity.
    assert f"JobName=retrainer-{cfg.name}-eval-{script.parent.name[:12]} " in job
    assert f"retrainer-{cfg.name}-{run.run_id}" not in job



def test_a_submitted_job_is_followed_from_elsewhere_and_its_deadline_cancels_it(
        slurm_cluster: SlurmCluster, tmp_path: Path, hooked, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Airflow's triggerer does with a deferred task's job: submit returns at once with a JSON handle;
    `follow` (a launcher of its own, as a re-created trigger has) waits for it and `collect` returns the
    summary; a job still running at its deadline is cancelled on every node and fails naming the deadline."""
    import asyncio
    import time

    from tasks.base.errors import TrainingFailedError
    from tasks.launch import cancel, collect, follow
    from tasks.runs.identity import for_dataset

    hooked(HOOK_STEP_DELAY_S="1")
    for name, value in slurm_cluster.env.items():  # the triggerer's environment reaches Slurm the same way
        monkeypatch.setenv(name, value)
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.slurm.time_limit": "00:10:00",
                                 "train.steps": 3}, out="slurm")
    handle = json.loads(json.dumps(get_launcher(cfg).submit(cfg, dataset, run=for_dataset(cfg, dataset))))
    outcome = asyncio.run(follow(cfg, handle))
    assert outcome.rc == 0 and not outcome.preempted, outcome
    summary = collect(cfg, handle, outcome)
    assert len(summary["losses"]) == 3 and summary["trained_steps"] == 3

    slow = cfg.with_overrides({"train.steps": 60, "train.output_dir": str(tmp_path / "slow")})
    handle = get_launcher(slow).submit(slow, dataset, run=for_dataset(slow, dataset))
    wait_for_step(slow.train.output_dir, 1)
    outcome = asyncio.run(follow(slow, handle, deadline=time.time()))
    assert outcome.timed_out is not None and job_processes(handle["job_id"]) == []
    assert "JobState=CANCELLED" in slurm_cluster.run("scontrol", "show", "job", "-o", handle["job_id"]).stdout
    with pytest.raises(TrainingFailedError, match=r"timed out .* deadline"):
        collect(slow, handle, outcome)

    # What a killed deferred task's trigger does (on_kill): stop a running job by its handle.
    handle = get_launcher(slow).submit(slow, dataset, run=for_dataset(slow, dataset))
    wait_for_step(slow.train.output_dir, 1)
    cancel(slow, json.loads(json.dumps(handle)))
    assert "JobState=CANCELLED" in slurm_cluster.run("scontrol", "show", "job", "-o", handle["job_id"]).stdout
    assert job_processes(handle["job_id"]) == []


def test_a_ranks_exception_reaches_the_error_a_deferred_task_collects(
        slurm_cluster: SlurmCluster, tmp_path: Path, hooked, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Submitted, followed and collected as a deferred Airflow task does (its outcome travels as JSON, from
    the triggerer to the task): the last rank dies of an IndexError at step 2, and the collected error names
    the rank, the exception, its message and the line of our code, as the job's output file had it; the
    traceback goes to the collecting task's log."""
    import asyncio

    from tasks.base.errors import TrainingFailedError
    from tasks.launch import Outcome, collect, follow
    from tasks.runs.identity import for_dataset

    hooked(HOOK_BAD_TOKEN_AT="2:1")
    for name, value in slurm_cluster.env.items():
        monkeypatch.setenv(name, value)
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.slurm.time_limit": "00:10:00",
                                 "parallel.dp": 2, "train.steps": 4}, out="slurm")
    handle = json.loads(json.dumps(get_launcher(cfg).submit(cfg, dataset, run=for_dataset(cfg, dataset))))
    outcome = Outcome.from_dict(json.loads(json.dumps(asyncio.run(follow(cfg, handle)).to_dict())))
    assert outcome.rc != 0 and not outcome.preempted, outcome
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="tasks.launch.base"), pytest.raises(TrainingFailedError) as failed:
        collect(cfg, handle, outcome)
    where = source_line("tasks/models/gpt/model.py", "self.drop(self.tok(tokens)")
    assert re.fullmatch(r"training of tiny-test failed \(slurm launcher\): rank 1 failed: IndexError: index out of "
                        rf"range in self \({re.escape(where)} on \S+\)", str(failed.value)), str(failed.value)
    (logged,) = [r.getMessage() for r in caplog.records if r.name == "tasks.launch.base"]
    assert logged.startswith(f"{failed.value}".split(": ", 1)[1]) and "Traceback (most recent call last)" in logged
    assert job_processes(handle["job_id"]) == []


def _failing_first(bin_dir: Path, tool: str, script: str) -> None:
    """`tool` on PATH in `bin_dir`: `script` (bash, `$REAL` the real binary, `$N` this call's number from 0)."""
    real = shutil.which(tool)
    assert real is not None, tool
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / tool
    wrapper.write_text(f'#!/bin/bash\nREAL={real}\nN=$(cat {bin_dir}/{tool}.calls 2>/dev/null || echo 0)\n'
                       f'echo $((N + 1)) > {bin_dir}/{tool}.calls\n{script}\n')
    wrapper.chmod(0o755)


def test_a_submission_that_dies_on_the_way_is_sent_again_and_one_that_was_queued_is_followed_not_doubled(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """sbatch killed by SIGPIPE before it reached the controller (seen in CI: the Airflow try failed), then
    killed after the controller queued the job: the launcher submits once more, then follows the queued job
    instead of a third submission. A controller that times out is asked again, not taken for a job's end."""
    from tasks.config.cluster import SlurmConfig
    from tasks.launch.slurm import UNKNOWN, SlurmLauncher

    bin_dir = tmp_path / "bin"
    _failing_first(bin_dir, "sbatch", 'if [ "$N" = 0 ]; then kill -PIPE $$; fi\n'
                                      'if [ "$N" = 1 ]; then "$REAL" "$@" > /dev/null; kill -PIPE $$; fi\n'
                                      'exec "$REAL" "$@"')
    env = {**slurm_cluster.env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    launcher = SlurmLauncher(SlurmConfig(), env=env)
    name = f"retrainer-submit-{tmp_path.name}"
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --output={tmp_path}/out-%j\n"
                      "#SBATCH --time=00:01:00\nsleep 60\n")
    try:
        job_id = launcher.sbatch(script, env, name)
        assert (bin_dir / "sbatch.calls").read_text().strip() == "2"  # never a third submission
        listed = slurm_cluster.run("squeue", "-h", "--name", name, "-t", "all", "-o", "%i").stdout.split()
        assert listed == [job_id]
        assert launcher.state(job_id)[0] in ("PENDING", "RUNNING")

        _failing_first(bin_dir, "scontrol", 'if [ "$N" = 0 ]; then echo "slurm_load_jobs error: Socket timed out '
                                            'on send/recv operation" >&2; exit 1; fi\nexec "$REAL" "$@"')
        assert launcher.state(job_id) == (UNKNOWN, 0)
        assert launcher.state(job_id)[0] in ("PENDING", "RUNNING")
        assert launcher.state("999999999") == ("GONE", 1)  # a record the controller no longer holds
    finally:
        for job_id in slurm_cluster.run("squeue", "-h", "--name", name, "-o", "%i").stdout.split():
            slurm_cluster.run("scancel", job_id)
