"""Secrets while the ranks run, and after a SIGKILL of the task: nothing under the run directory, the cache
or $TMPDIR, no process's command line and no rank's environment holds the DB password or the S3 keys.

The task has them all (a password in the registry URL, S3 keys in the data's storage options, AWS keys in
its environment); the ranks need none of them (tasks/launch/torchrun.py: a `TrainingJob` and an
allow-listed environment). The ssh launcher's side of this is in tests/launch/test_ssh.py.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import yaml

from tasks.data.synthetic import make_data
from tests.faults.conftest import TaskProcess, driver, finished_steps, make_job, processes_mentioning, reap, task_env
from tests.secrets_scan import argv_containing, environments_containing, files_containing
from tests.services import S3Endpoint


def test_no_secret_on_disk_in_argv_or_rank_env_while_training_and_after_a_sigkill(
    tmp_path: Path, pg_url: str, s3: S3Endpoint, s3_bucket: str, no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    db_password = f"dbpw-{secrets.token_hex(8)}"
    s3_key, s3_secret = f"AKIA{secrets.token_hex(8).upper()}", f"s3sk-{secrets.token_hex(16)}"
    aws_secret = f"aws-{secrets.token_hex(16)}"
    values = [db_password, s3_key, s3_secret, aws_secret]
    tmpdir = tmp_path / "task-tmp"
    tmpdir.mkdir()
    env = task_env(FAULT_DB_PASSWORD=db_password, FAULT_S3_KEY=s3_key, FAULT_S3_SECRET=s3_secret,
                   AWS_SECRET_ACCESS_KEY=aws_secret, AWS_ACCESS_KEY_ID=s3_key, TMPDIR=str(tmpdir),
                   HOOK_STEP_DELAY_S="2")

    job = make_job(tmp_path, pg_url.replace("postgres@", "postgres:${FAULT_DB_PASSWORD}@", 1), steps=8)
    make_data(f"s3://{s3_bucket}/corpus", name="tiny-llama", n_train_shards=2, tokens_per_shard=16384,
              storage_options=s3.storage_options)
    cfg = yaml.safe_load(job.config.read_text())
    cfg["data"].update(source_url=f"s3://{s3_bucket}/corpus",
                       storage_options={"key": "${FAULT_S3_KEY}", "secret": "${FAULT_S3_SECRET}",
                                        "client_kwargs": {"endpoint_url": s3.endpoint_url}})
    job.config.write_text(yaml.safe_dump(cfg))
    state = tmp_path / "state"
    # This process reads the config only to find the run directory; a `${VAR}` must be set to load it, and here
    # it is set to values that are not the task's secrets (those live in the task's environment alone).
    for name in ("FAULT_DB_PASSWORD", "FAULT_S3_KEY", "FAULT_S3_SECRET"):
        monkeypatch.setenv(name, "not-the-tasks-secret")
    task = TaskProcess(driver(job, state, "plan", "warm", "train"), tmp_path / "task.log", env)
    try:
        task.wait_for(lambda: (state / "plan.json").exists() and finished_steps(job.run_dir(state)) >= 1,
                      "the first step", timeout=600)
        run_dir = job.run_dir(state)
        roots = [run_dir, Path(cfg["data"]["cache_dir"]), tmpdir]
        assert (run_dir / "status.json").exists() and list(run_dir.glob("worker-config.*.json"))  # really running
        assert files_containing(roots, values) == []
        assert argv_containing(values) == []
        ranks = [p.pid for p in tagged_ranks(tmp_path)]
        assert len(ranks) >= 2
        assert environments_containing(ranks, values) == []
    finally:
        task.sigkill()
        reap(processes_mentioning(str(tmp_path)))
    assert files_containing(roots, values) == []  # nothing left behind by the killed task either


def tagged_ranks(under: Path):
    """Live training ranks (their launch tag set) of this test's launch: their command line names a path under
    `under` (another test's ranks may run beside them)."""
    import psutil

    from tasks.launch.procs import TAG_VAR
    from tests.launch.helpers import is_rank

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "tests.hooks.worker" in cmd and str(under) in " ".join(cmd) and is_rank(proc):
            try:
                if f"{TAG_VAR}=".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes():
                    found.append(proc)
            except OSError:
                continue
    return found
