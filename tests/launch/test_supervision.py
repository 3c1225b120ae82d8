"""Building blocks of every launcher, on real processes and files: tagged cleanup, hang detection, input checks."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tasks.base.errors import ConfigError, InvalidInputError
from tasks.base.job_status import Status
from tasks.config.cluster import SlurmConfig
from tasks.launch import JobSpec, get_launcher, pool_for
from tasks.launch.local import LocalLauncher
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


def test_progress_watcher_follows_the_status_and_names_the_last_step() -> None:
    def status(step: int, state: str = "training", reason: str | None = None) -> Status:
        return Status(state=state, step=step, steps=20, loss=1.0, at=time.time(), reason=reason)  # type: ignore

    watcher = ProgressWatcher(timeout_s=0.3, startup_timeout_s=5)
    watcher.observe(None)
    watcher.observe(status(7))  # where this launch starts (a resumed run)
    time.sleep(0.4)
    assert not watcher.hung()  # still starting up: the startup allowance applies
    watcher.observe(status(8))
    assert watcher.last_step == 8
    time.sleep(0.4)
    assert watcher.hung() and "last finished step 8" in watcher.describe()
    watcher.observe(status(9))
    assert not watcher.hung() and watcher.last_step == 9
    watcher.observe(status(9, "failed", "non-finite loss at step 10 (nan)"))
    assert watcher.failure == "non-finite loss at step 10 (nan)"


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


def test_slurm_script_runs_one_spawn_per_node_with_rank_and_rendezvous_from_slurm(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.partition": "gpu", "parallel.dp": 4,
                                 "cluster.slurm": {"nodes": 2, "time_limit": "1-02:00", "gpus_per_node": 2,
                                                   "sbatch_args": ["--account=ml", "--exclusive"],
                                                   "python": "/opt/py", "workdir": "/srv"}})
    script = render_script(cfg, cfg.cluster.slurm, JobSpec("0123456789abcdef", tmp_path / "run"), tmp_path / "ds",
                           tmp_path / "c.json")
    lines = script.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --partition=gpu" in lines
    assert "#SBATCH --gpus-per-node=2" in lines and "#SBATCH --time=1-02:00" in lines
    assert "#SBATCH --account=ml" in lines and "#SBATCH --exclusive" in lines and "cd /srv" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert '--node-rank="$SLURM_NODEID"' in srun and '--master-addr="$RETRAINER_MASTER_ADDR"' in srun
    assert "--nnodes=2" in srun and "--nproc-per-node=2" in srun and "--kill-on-bad-exit=1" in srun
    assert srun.split("bash -c ")[1].startswith("'/opt/py -m tasks.base.spawn")
    assert "#SBATCH --job-name=retrainer-tiny-test-0123456789abcdef" in lines  # how a retry finds this run's job
    assert f"#SBATCH --output={tmp_path / 'run'}/slurm-%j.out" in lines
    default = render_script(tiny_config(tmp_path), SlurmConfig(), JobSpec("0" * 16, tmp_path / "run"),
                            tmp_path / "ds", tmp_path / "c.json")
    assert "#SBATCH --time=24:00:00" in default and "--gpus-per-node" not in default  # CPU partitions ask none
    assert "--qos" not in default and "--priority" not in default


def test_slurm_script_carries_the_qos_and_with_job_priority_the_schedule_priority(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "schedule": {"cron": "@daily", "priority": 40},
                                 "cluster.slurm": {"qos": "prod-retrain", "job_priority": True}})
    lines = render_script(cfg, cfg.cluster.slurm, JobSpec("0" * 16, tmp_path / "run"), tmp_path / "ds",
                          tmp_path / "c.json").splitlines()
    assert "#SBATCH --qos=prod-retrain" in lines and "#SBATCH --priority=40" in lines


def test_ssh_options_from_the_config_reach_the_ssh_command(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "ssh", "cluster.hosts": ["10.0.0.1", "10.0.0.2"],
                                 "cluster.master_addr": "10.0.0.1", "parallel.dp": 2,
                                 "cluster.ssh": {"user": "ml", "port": 2222, "identity_file": "/keys/id",
                                                 "ssh_options": ["ProxyJump=bastion"], "connect_timeout_s": 7,
                                                 "python": "/opt/py", "workdir": "/srv/retrainer", "grace_s": 4}})
    launcher = get_launcher(cfg, env={"NCCL_IB_HCA": "mlx5"})
    cmd = launcher.ssh_base("10.0.0.2")
    pairs = {cmd[i + 1] for i, word in enumerate(cmd) if word == "-o"}
    assert cmd[:3] == ["ssh", "-p", "2222"] and cmd[-1] == "ml@10.0.0.2"
    assert {"ConnectTimeout=7", "ProxyJump=bastion", "IdentitiesOnly=yes", "BatchMode=yes"} <= pairs
    assert cmd[cmd.index("-i") + 1] == "/keys/id"
    remote = launcher.remote_command(cfg, JobSpec("0" * 16, tmp_path / "run"), tmp_path / "ds", tmp_path / "c.json",
                                     "ab" * 16, 2, 1, evaluation=False)
    words = shlex.split(remote)
    assert words[:2] == ["cd", "/srv/retrainer"]
    # The environment travels on the agent's stdin, never on its command line (`ps` would show it).
    assert not any("NCCL_IB_HCA" in w for w in words) and "--env-stdin" in words
    assert launcher.node_env("ab" * 16, 1, {})["NCCL_IB_HCA"] == "mlx5"
    assert launcher.node_env("ab" * 16, 1, {})["MALLOC_MMAP_THRESHOLD_"] == str(2 << 20)  # a training rank's
    assert launcher.node_env("ab" * 16, 1, {}, evaluation=True)["MALLOC_TRIM_THRESHOLD_"] == str(64 << 20)
    agent = words.index("tasks.launch.agent")
    assert words[agent - 2 : agent] == ["/opt/py", "-m"] and words[words.index("--grace") + 1] == "4.0"
    assert "--node-rank=1" in words and "--nproc-per-node=1" in words


@pytest.mark.parametrize(("section", "values", "field"), [
    ("slurm", {"time_limit": "2 hours"}, "cluster.slurm.time_limit"),
    ("slurm", {"time_limit": "1:75:00"}, "cluster.slurm.time_limit"),
    ("slurm", {"sbatch_args": ["account=ml"]}, "cluster.slurm.sbatch_args"),
    ("slurm", {"nodes": 0}, "cluster.slurm.nodes"),
    ("ssh", {"port": 0}, "cluster.ssh.port"),
    ("ssh", {"port": 65536}, "cluster.ssh.port"),
    ("ssh", {"user": "-oProxyCommand=x"}, "cluster.ssh.user"),
    ("ssh", {"ssh_options": ["-v"]}, "cluster.ssh.ssh_options"),
    ("ssh", {"workdir": "relative/dir"}, "cluster.ssh.workdir"),
    ("kubernetes", {"cpu": "eight"}, "cluster.kubernetes.cpu"),
    ("kubernetes", {"memory": "64GB"}, "cluster.kubernetes.memory"),
    ("kubernetes", {"env_from_secrets": {"TOKEN": {"secret": "Bad_Name", "key": "k"}}},
     "cluster.kubernetes.env_from_secrets.TOKEN.secret"),
    ("kubernetes", {"env": {"A": "1"}, "env_from_secrets": {"A": {"secret": "s", "key": "k"}}},
     "cluster.kubernetes.env and env_from_secrets both set ['A']"),
    ("kubernetes", {"service_account": "Trainer"}, "cluster.kubernetes.service_account"),
    ("kubernetes", {"replicas": 2}, "cluster.kubernetes.replicas"),
])
def test_engine_sections_are_validated_at_load_naming_the_field(tmp_path: Path, section: str, values: dict,
                                                               field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        tiny_config(tmp_path, {f"cluster.{section}": values})


def test_a_section_of_another_engine_is_carried_but_unused(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.slurm.time_limit": "00:30:00", "cluster.kubernetes.cpu": "4"})
    assert isinstance(get_launcher(cfg), LocalLauncher) and cfg.cluster.slurm.time_limit == "00:30:00"


def test_pool_is_per_cluster_and_sized_in_ranks(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "slurm", "cluster.partition": "a100", "parallel.dp": 4})
    assert pool_for(cfg) == ("training-slurm-a100", 4)
    assert pool_for(tiny_config(tmp_path)) == ("training-local", 1)


def test_a_ranks_failure_is_not_overwritten_by_another_ranks_progress(tmp_path: Path) -> None:
    """Rank 1 fails; rank 0, not yet aware, reports its next step: the launcher must still read rank 1's reason."""
    from tasks.base.job_status import read_status, write_status

    write_status(tmp_path, Status(state="training", step=3, steps=6, at=1.0, rank=0))
    write_status(tmp_path, Status(state="failed", step=4, steps=6, at=2.0, reason="No space left on device", rank=1))
    write_status(tmp_path, Status(state="training", step=4, steps=6, at=3.0, rank=0))
    got = read_status(tmp_path / "status.json")
    assert got is not None and (got.state, got.reason, got.rank) == ("failed", "No space left on device", 1)
    # a second failure's reason is as true: it replaces the first (each rank says what it knows)
    write_status(tmp_path, Status(state="failed", step=4, steps=6, at=4.0, reason="peer gone", rank=0))
    got = read_status(tmp_path / "status.json")
    assert got is not None and got.reason == "peer gone"


def test_a_tagged_line_reaches_the_pipe_in_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's warm report, a relayed status or summary: the node's stderr shares the launcher's pipe (over ssh:
    another channel), so a line written as text and then newline could be split by a log line (seen in CI)."""
    import io
    import sys

    from tasks.base.job_status import print_line

    class Recorder(io.RawIOBase):
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:  # type: ignore[override]
            self.writes.append(bytes(data))
            return len(data)

    raw = Recorder()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=True))  # stdout as `python -u` has it
    print("RETRAINER-WARM {}", flush=True)
    assert raw.writes == [b"RETRAINER-WARM {}", b"\n"]  # what `print` did: two writes, room for a line between
    raw.writes.clear()
    print_line('RETRAINER-WARM {"node": "n1"}')
    assert raw.writes == [b'RETRAINER-WARM {"node": "n1"}\n']


def test_a_process_whose_environment_cannot_be_read_is_skipped_not_waited_for(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A read of /proc/PID/environ waits on that process's memory-map lock (a process stuck on a hung disk holds it
    for the stall): the scan goes on without it, warns once, and reads it again once the read returns."""
    from tasks.launch import procs

    tag = new_tag()
    env = {**os.environ, TAG_VAR: tag}
    stuck, healthy = (subprocess.Popen(["sleep", "300"], env=env) for _ in range(2))
    released, real_read = threading.Event(), procs._environ

    def read(pid: int) -> list[bytes]:
        if pid == stuck.pid:
            released.wait(30)  # the kernel's read, blocked until the stall ends
        return real_read(pid)

    monkeypatch.setattr(procs, "_environ", read)
    monkeypatch.setattr(procs, "ENVIRON_READ_TIMEOUT_S", 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="tasks.launch.procs"):
            assert [p.pid for p in tagged(tag)] == [healthy.pid]
            assert [p.pid for p in tagged(tag)] == [healthy.pid]  # skipped while the first read still waits
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and f"process {stuck.pid}: its environment could not be read" in warned[0]
        released.set()
        deadline = time.monotonic() + 10
        while len(tagged(tag)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.pid for p in tagged(tag)) == sorted([stuck.pid, healthy.pid])
    finally:
        released.set()
        assert stop_all(tag, grace_s=2) == 2
        stuck.wait(5), healthy.wait(5)
