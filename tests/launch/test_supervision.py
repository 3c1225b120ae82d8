"""Building blocks of every launcher, on real processes and files: tagged cleanup, hang detection, input checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tasks.errors import InvalidInputError
from tasks.launch import get_launcher, pool_for
from tasks.launch.procs import TAG_VAR, new_tag, stop_all, tagged
from tasks.launch.slurm import render_script
from tasks.launch.watch import ProgressWatcher
from tests.launch.conftest import tiny_config, write_dataset


def test_stop_all_reaches_stopped_orphaned_and_new_session_processes() -> None:
    tag = new_tag()
    env = {**os.environ, TAG_VAR: tag}
    # A parent with a child in its own session (like torchrun's ranks), one that ignores SIGTERM,
    # and an orphan whose parent already exited (re-parented to init: no tree walk finds it).
    parent = subprocess.Popen(["bash", "-c", "setsid sleep 300 & trap '' TERM; sleep 300 & wait"], env=env,
                              start_new_session=True)
    orphan_maker = subprocess.run(["bash", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo $!"],
                                  env=env, capture_output=True, text=True, check=True)
    orphan = int(orphan_maker.stdout.strip())
    deadline = time.monotonic() + 10
    while len(tagged(tag)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = tagged(tag)
    assert len(procs) >= 4 and orphan in {p.pid for p in procs}
    os.kill(orphan, signal.SIGSTOP)  # a hung process must still be stopped

    assert stop_all(tag, root_pid=parent.pid, grace_s=2) >= 4
    parent.wait(timeout=5)
    assert tagged(tag) == []
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE


def test_progress_watcher_counts_only_new_lines_and_names_the_last_step(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.jsonl"
    path.write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")  # a previous attempt's lines
    watcher = ProgressWatcher(path, timeout_s=0.3)
    assert not watcher.poll() and watcher.last_step is None
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 8, "loss": 0.9}) + "\n" + '{"step": 9, "lo')  # a half-written line
    assert watcher.poll() and watcher.last_step == 8
    time.sleep(0.4)
    assert watcher.hung()
    assert "last finished step 8" in watcher.describe()
    with open(path, "a") as fh:
        fh.write('ss": 0.8}\n')
    assert not watcher.hung() and watcher.last_step == 9
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")  # a fresh run truncates
    assert watcher.poll() and watcher.last_step == 1


def test_ssh_launcher_refuses_bad_hosts_before_writing_anything(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    no_hosts = tiny_config(tmp_path, {"cluster.launcher": "ssh"})
    with pytest.raises(InvalidInputError, match=r"cluster\.hosts"):
        get_launcher(no_hosts).run(no_hosts, dataset)
    loopback = tiny_config(tmp_path, {"cluster.launcher": "ssh", "cluster.hosts": ["a", "b"], "parallel.dp": 2})
    with pytest.raises(InvalidInputError, match=r"cluster\.master_addr"):
        get_launcher(loopback).run(loopback, dataset)
    uneven = tiny_config(tmp_path, {"cluster.launcher": "ssh", "cluster.hosts": ["a", "b"], "parallel.dp": 3,
                                    "cluster.master_addr": "10.0.0.1"})
    with pytest.raises(InvalidInputError, match="2 node"):
        get_launcher(uneven).run(uneven, dataset)
    assert not Path(no_hosts.train.output_dir).exists()


def test_missing_dataset_fails_before_any_launch(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    with pytest.raises(InvalidInputError, match="manifest"):
        get_launcher(cfg).run(cfg, tmp_path / "nowhere")
    assert not Path(cfg.train.output_dir).exists()


def test_slurm_script_runs_one_torchrun_per_node_with_rank_and_rendezvous_from_slurm(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.partition": "gpu", "parallel.dp": 4})
    script = render_script(cfg, tmp_path / "ds", tmp_path / "c.json", nodes=2, python="/opt/py", workdir="/srv",
                           time_limit="02:00:00", gpus_per_node=2)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=gpu" in script
    assert "#SBATCH --gpus-per-node=2" in script and "#SBATCH --time=02:00:00" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert '--node-rank="$SLURM_NODEID"' in srun and '--master-addr="$RETRAINER_MASTER_ADDR"' in srun
    assert "--nnodes=2" in srun and "--nproc-per-node=2" in srun and "--kill-on-bad-exit=1" in srun


def test_pool_is_per_cluster_and_sized_in_ranks(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.partition": "a100", "parallel.dp": 4})
    assert pool_for(cfg) == ("training-slurm-a100", 4)
    assert pool_for(tiny_config(tmp_path)) == ("training-local", 1)
