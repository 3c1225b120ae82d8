"""`ssh`: one `torchrun --nnodes N --node-rank i` per host, each started over SSH under the node agent.

Why per-node torchrun over plain ssh (and not the DeepSpeed launcher's pdsh
fan-out): every node's job runs under `tasks.launch.agent`, whose stdin is our
ssh channel, so a cancelled or killed launcher always takes the ranks with it,
and each node's exit status comes back separately. The rendezvous is
torchrun's static one at `cluster.master_addr:cluster.master_port` (the first
host). The environment the ranks need (OMP/NCCL/GLOO/TORCH/PYTHON*/CUDA/
RETRAINER_* variables and explicit extras) is propagated on the command line;
values are never logged. Every node must see the repository, the dataset and
the output dir at the same paths (shared filesystem), like DeepSpeed's launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
import threading
from pathlib import Path

from tasks.config import JobConfig, SshConfig
from tasks.errors import InvalidInputError, RetrainerError
from tasks.launch.base import Job, Launcher
from tasks.launch.logs import LineSink, pump
from tasks.launch.procs import TAG_VAR, die_with_parent, stop_all

log = logging.getLogger(__name__)

ENV_PREFIXES = ("OMP_", "NCCL_", "GLOO_", "TORCH_", "PYTHON", "CUDA_", "RETRAINER_", "MKL_", "TP_SOCKET_IFNAME")


class SshJob(Job):
    def __init__(self, launcher: SshLauncher, hosts: list[str], remote_cmds: list[str], tag: str) -> None:
        self.launcher, self.hosts, self.tag = launcher, hosts, tag
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[tuple[LineSink, threading.Thread]] = []
        self._stopped = False
        for host, remote in zip(hosts, remote_cmds, strict=True):
            proc = subprocess.Popen(
                [*launcher.ssh_base(host), remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=die_with_parent,
                env={**os.environ, TAG_VAR: node_tag(tag, "client")},
            )
            self.procs.append(proc)
            sink = LineSink(logging.getLogger("tasks.launch.ranks"), prefix=f"[{host}] ")
            self.readers.append((sink, pump(proc.stdout, sink, name=f"ssh-{host}")))  # type: ignore[arg-type]

    @property
    def failure(self) -> str | None:  # type: ignore[override]
        return next((s.failure for s, _ in self.readers if s.failure), None)

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        for host, rc in zip(self.hosts, codes, strict=True):
            if rc not in (None, 0):
                log.error("ssh: node %s exited with status %s", host, rc)
                return rc
        return None if None in codes else 0

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for proc in self.procs:  # EOF on the agent's stdin: it stops its node and waits until clean
            if proc.stdin and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        wait_s = 2 * self.launcher.section.grace_s + 30
        for host, proc in zip(self.hosts, self.procs, strict=True):
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                log.error("ssh: node %s did not confirm its cleanup in %.0fs; dropping the connection", host, wait_s)
        stop_all(node_tag(self.tag, "client"), grace_s=5)  # local ssh clients, if any is left
        for _, reader in self.readers:
            reader.join(timeout=10)
        dirty = [host for i, host in enumerate(self.hosts) if not self.launcher.reap(host, node_tag(self.tag, i))]
        if dirty:
            raise RetrainerError(f"ssh launcher: could not confirm that nodes {dirty} have no training process left")


class SshLauncher(Launcher):
    """Reaches every host of `cluster.hosts` as `cluster.ssh` says; `env` adds variables for the ranks."""

    name = "ssh"

    def __init__(self, section: SshConfig, *, env: dict[str, str] | None = None) -> None:
        self.section, self.env = section, dict(env or {})

    def ssh_base(self, host: str) -> list[str]:
        s = self.section
        cmd = ["ssh", "-p", str(s.port), "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
               "-o", f"ConnectTimeout={s.connect_timeout_s}",
               "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
        if s.identity_file:
            cmd += ["-i", s.identity_file, "-o", "IdentitiesOnly=yes"]
        for opt in s.ssh_options:
            cmd += ["-o", opt]
        return [*cmd, f"{s.user}@{host}" if s.user else host]

    def _hosts(self, cfg: JobConfig) -> list[str]:
        hosts = list(cfg.cluster.hosts)
        if not hosts:
            raise InvalidInputError("cluster.hosts: the ssh launcher needs at least one host")
        if len(set(hosts)) != len(hosts):
            raise InvalidInputError(f"cluster.hosts: duplicate host in {hosts}")
        if len(hosts) > 1 and cfg.cluster.master_addr in {"127.0.0.1", "localhost", "::1"}:
            raise InvalidInputError("cluster.master_addr: with several hosts it must be an address every node "
                                    f"reaches (usually the first host), not {cfg.cluster.master_addr!r}")
        return hosts

    def prepare(self, cfg: JobConfig, dataset_dir: Path) -> None:
        from tasks.train.launch import torchrun_command

        hosts = self._hosts(cfg)  # and torchrun_command validates the node/process split
        torchrun_command(cfg, dataset_dir, "config.json", nnodes=len(hosts), python=self.section.python)

    def remote_command(self, cfg: JobConfig, dataset_dir: Path, config_json: Path, tag: str,
                       nnodes: int, node_rank: int) -> str:
        from tasks.train.launch import torchrun_command, worker_env

        cmd = torchrun_command(cfg, dataset_dir, config_json, nnodes=nnodes, node_rank=node_rank,
                               python=self.section.python)
        env = {k: v for k, v in worker_env(self.env).items() if k.startswith(ENV_PREFIXES) or k in self.env}
        env[TAG_VAR] = node_tag(tag, node_rank)
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
        agent = [self.section.python, "-m", "tasks.launch.agent", "run", "--tag", node_tag(tag, node_rank),
                 "--grace", str(self.section.grace_s), "--"]
        return (f"cd {shlex.quote(self.section.workdir)} && exec env {assignments} "
                + " ".join(shlex.quote(a) for a in [*agent, *cmd]))

    def start(self, cfg: JobConfig, dataset_dir: Path, config_json: Path, tag: str) -> Job:
        hosts = self._hosts(cfg)
        remotes = [self.remote_command(cfg, dataset_dir, config_json, tag, len(hosts), i) for i in range(len(hosts))]
        log.info("ssh: launching %d node(s) x %d ranks on %s, rendezvous %s:%d (env keys propagated: %s)",
                 len(hosts), cfg.parallel.world_size // len(hosts), hosts, cfg.cluster.master_addr,
                 cfg.cluster.master_port, ", ".join(sorted(_propagated_keys(remotes[0]))))
        return SshJob(self, hosts, remotes, tag)

    def reap(self, host: str, tag: str) -> bool:
        """Stop any leftover of the launch on `host`; True when the node confirms none is left."""
        remote = (f"cd {shlex.quote(self.section.workdir)} && exec {shlex.quote(self.section.python)} "
                  f"-m tasks.launch.agent reap --tag {tag} --grace {self.section.grace_s}")
        try:
            done = subprocess.run([*self.ssh_base(host), remote], stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=2 * self.section.grace_s + 60)
        except subprocess.TimeoutExpired:
            log.error("ssh: reap on %s timed out", host)
            return False
        log.info("ssh: node %s clean check: %s", host, (done.stdout or done.stderr).strip().splitlines()[-1:])
        return done.returncode == 0


def node_tag(tag: str, node: int | str) -> str:
    """Each node's processes get their own tag, so one node's cleanup never touches another's
    (hosts that share a process table, like the network-namespace test hosts, stay independent)."""
    return f"{tag}.{node}"


def _propagated_keys(remote: str) -> list[str]:
    words = shlex.split(remote)
    start = words.index("env") + 1
    return [w.split("=", 1)[0] for w in words[start:] if "=" in w and not w.startswith("-")][: 64]
