"""`ssh`: one `tasks.base.spawn --nnodes N --node-rank i` per host, each started over SSH under the node agent.

Why one spawn per node over plain ssh (and not the DeepSpeed launcher's pdsh
fan-out): every node's job runs under `tasks.launch.agent`, whose stdin is our
ssh channel, so a cancelled or killed launcher always takes the ranks with it,
and each node's exit status comes back separately. The rendezvous is
static, at `cluster.master_addr:cluster.master_port` (the first
host). The environment the ranks need (the OMP/NCCL/GLOO/TORCH/PYTHON/CUDA/MKL part
of the ranks' allow-listed environment, and explicit extras) goes to each agent as
the first line on its stdin: never on a command line (`ps` on a node shows those),
never in a file. Node 0's agent relays the run's status file. Run from the
lifecycle, every host first warms the dataset and the starting weights into its
own `data.cache_dir` (in parallel, one `tasks.inputs.node` per host under the
agent, the spec on its stdin), and the ranks read from that local copy. Every
node must see the repository and the run directory at the same paths.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from tasks.base.errors import InvalidInputError, RetrainerError, TrainingFailedError
from tasks.base.job_status import STATUS_FILE, Status
from tasks.base.rank_failure import RankFailure, earliest
from tasks.base.spawn import die_with_parent
from tasks.config.cluster import SshConfig
from tasks.config.schema import JobConfig
from tasks.inputs.node import SPEC_VAR, describe, forwarded_env, node_spec, parse_report
from tasks.launch import torchrun
from tasks.launch.base import Job, Launcher
from tasks.launch.logs import LineSink, pump
from tasks.launch.procs import TAG_VAR, new_tag, stop_all
from tasks.launch.spec import JobSpec, LaunchOptions
from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)


class SshJob(Job):
    def __init__(self, launcher: SshLauncher, hosts: list[str], remote_cmds: list[str], envs: list[dict[str, str]],
                 tag: str, files: dict[str, str]) -> None:
        self.launcher, self.hosts, self.tag = launcher, hosts, tag
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[tuple[LineSink, threading.Thread]] = []
        self._stopped = False
        for host, remote, env in zip(hosts, remote_cmds, envs, strict=True):
            proc = subprocess.Popen(
                [*launcher.ssh_base(host), remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=die_with_parent,
                env={**os.environ, TAG_VAR: node_tag(tag, "client")},
            )
            self.procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(env) + "\n")  # the agent's --env-stdin line
            proc.stdin.write(json.dumps(files) + "\n")  # --files-stdin: the job's input; stdin then stays open
            proc.stdin.flush()
            sink = LineSink(logging.getLogger("tasks.launch.ranks"), prefix=f"[{host}] ")
            self.readers.append((sink, pump(proc.stdout, sink, name=f"ssh-{host}")))  # type: ignore[arg-type]

    def status(self) -> Status | None:
        relayed = [s.status for s, _ in self.readers if s.status is not None]
        return max(relayed, key=lambda st: st.at) if relayed else None

    def rank_failure(self) -> RankFailure | None:
        return earliest(sink.rank_failure for sink, _ in self.readers)

    def summary(self) -> dict[str, object] | None:
        for sink, reader in self.readers:
            reader.join(timeout=10)  # the relay line comes just before the node's agent exits
            if sink.summary is not None:
                return sink.summary
        return None

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
    warms_nodes = True

    def __init__(self, section: SshConfig, *, env: dict[str, str] | None = None) -> None:
        self.section, self.env = section, dict(env or {})
        self.datasets: dict[str, str] = {}  # host -> the dataset dir its warm verified

    def warm_nodes(self, cfg: JobConfig, spec: JobSpec, run: RunIdentity,
                   options: LaunchOptions) -> list[dict[str, object]]:
        """Warm every host in parallel; refuse (naming the host) one that failed or verified other data."""
        hosts, tag = self._hosts(cfg), new_tag()
        warm_spec = json.dumps(node_spec(cfg, run, spec.output_dir))
        forwarded = forwarded_env()
        results: dict[str, tuple[int, dict[str, object] | None, list[str]]] = {}

        def warm_one(i: int, host: str) -> None:
            try:
                results[host] = warm_on(i, host)
            except Exception as exc:  # named below as this host's failure, never a lost thread
                results[host] = (-1, {"error": f"{type(exc).__name__}: {exc}"}, [])

        def warm_on(i: int, host: str) -> tuple[int, dict[str, object] | None, list[str]]:
            node = node_tag(tag, f"warm{i}")
            remote = (f"cd {shlex.quote(self.section.workdir)} && exec " + " ".join(shlex.quote(a) for a in [
                self.section.python, "-m", "tasks.launch.agent", "run", "--tag", node, "--grace",
                str(self.section.grace_s), "--watch-stdin", "--env-stdin", "--",
                self.section.python, "-m", "tasks.inputs.node"]))
            proc = subprocess.Popen([*self.ssh_base(host), remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                    preexec_fn=die_with_parent)
            assert proc.stdin is not None and proc.stdout is not None
            env = {**forwarded, **self.node_env(node, i, options.secret_env), SPEC_VAR: warm_spec, "NODE_NAME": host}
            proc.stdin.write(json.dumps(env) + "\n")
            proc.stdin.flush()
            report, tail = None, []
            for line in proc.stdout:
                line = line.rstrip("\n")
                if (parsed := parse_report(line)) is not None:
                    report = parsed
                    continue
                tail = [*tail[-9:], line]
                log.info("[%s] %s", host, line)
            proc.stdin.close()
            return proc.wait(), report, tail

        threads = [threading.Thread(target=warm_one, args=(i, h), name=f"warm-{h}") for i, h in enumerate(hosts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reports = []
        for host in hosts:
            rc, report, tail = results[host]
            if rc != 0 or report is None or "error" in report:
                why = (report or {}).get("error") or f"exit status {rc}: {' | '.join(tail[-3:]) or 'no output'}"
                raise TrainingFailedError(f"warm on node {host} failed, no rank started: {why}")
            if report["manifest_hash"] != run.data_manifest_hash:
                raise TrainingFailedError(f"node {host} verified manifest {str(report['manifest_hash'])[:12]}, "
                                          f"this run trains on {run.data_manifest_hash[:12]}; no rank started")
            log.info("ssh: %s", describe(report))
            self.datasets[host] = str(report["dataset_dir"])
            reports.append(report)
        return reports

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

    def prepare(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, options: LaunchOptions) -> None:
        hosts = self._hosts(cfg)  # and node_command validates the node/process split
        torchrun.node_command(cfg, dataset_dir, "config.json", nnodes=len(hosts), python=self.section.python,
                              evaluation=options.evaluating)

    def remote_command(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
                       nnodes: int, node_rank: int, *, evaluation: bool) -> str:
        """The node's command line: the agent (env from stdin, stdin = liveness) running the node's ranks. No values."""
        cmd = torchrun.node_command(cfg, dataset_dir, config_json, nnodes=nnodes, node_rank=node_rank,
                                    python=self.section.python, evaluation=evaluation)
        agent = [self.section.python, "-m", "tasks.launch.agent", "run", "--tag", node_tag(tag, node_rank),
                 "--grace", str(self.section.grace_s), "--watch-stdin", "--env-stdin", "--files-stdin"]
        if node_rank == 0:  # rank 0 runs there: its agent relays the status file and the summary
            out = spec.output_dir
            agent += ["--relay-status", str(out / STATUS_FILE), "--relay-summary", str(out / "summary.json")]
        return f"cd {shlex.quote(self.section.workdir)} && exec " + " ".join(shlex.quote(a) for a in [*agent, "--",
                                                                                                     *cmd])

    def node_env(self, tag: str, node_rank: int, secret_env: Mapping[str, str], *, evaluation: bool = False
                 ) -> dict[str, str]:
        """What node `node_rank`'s ranks (with `evaluation`, evaluation ranks) get in their environment (sent on the
        agent's stdin)."""
        env = {**torchrun.portable_env(torchrun.rank_env(self.env, evaluation=evaluation)), **self.env}
        return {**env, **secret_env, TAG_VAR: node_tag(tag, node_rank)}

    def start(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
              run: RunIdentity, options: LaunchOptions) -> Job:
        hosts = self._hosts(cfg)
        datasets = [Path(self.datasets.get(h, dataset_dir)) for h in hosts]  # each node's own, once warmed there
        remotes = [self.remote_command(cfg, spec, datasets[i], config_json, tag, len(hosts), i,
                                       evaluation=options.evaluating) for i in range(len(hosts))]
        envs = [self.node_env(tag, i, options.secret_env, evaluation=options.evaluating) for i in range(len(hosts))]
        log.info("ssh: launching %d node(s) x %d ranks on %s, rendezvous %s:%d (environment sent on stdin: %s)",
                 len(hosts), cfg.parallel.layout.world_size // len(hosts), hosts, cfg.cluster.master_addr,
                 cfg.cluster.master_port, ", ".join(sorted(envs[0])))
        files = {str(config_json): Path(config_json).read_text()}  # the run dir may be each node's own disk
        return SshJob(self, hosts, remotes, envs, tag, files)

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
