"""A real single-node Slurm for tests (munged + slurmctld + slurmd on private ports, dirs and munge socket):
the launcher tests and the Airflow deferral tests share one per session (fixture `slurm_cluster`)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import free_port, stop_daemon


@dataclass
class SlurmCluster:
    """munged + slurmctld + slurmd for one node, private ports, dirs and munge socket."""

    root: Path
    conf: Path
    node: str
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=30)


def slurm_daemons(root: Path) -> Iterator[SlurmCluster]:
    node = socket.gethostname()
    cpus = os.cpu_count() or 1
    key, sock = root / "munge.key", root / "munge.socket"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for d in ("state", "spool", "log"):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=retrainer-test", f"SlurmctldHost={node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "AuthType=auth/munge",
        f"AuthInfo=socket={sock}", "CredType=cred/munge", f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}", f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
        "SchedulerType=sched/backfill", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "KillWait=10", "MinJobAge=600",
        # Job ids of its own: each pytest-xdist worker may run a cluster, and tests find a job's processes by
        # SLURM_JOB_ID (tests/launch/test_slurm.py), which must not match the other cluster's job.
        f"FirstJobId={random.randrange(1, 60_000) * 1000}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", "",
    ]))
    cluster = SlurmCluster(root=root, conf=conf, node=node)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        munged = subprocess.Popen(["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                                   f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                                   f"--seed-file={root / 'munge.seed'}"],
                                  stdout=subprocess.DEVNULL, stderr=open(root / "log" / "munged.err", "wb"))  # noqa: SIM115
        cluster.daemons.append(munged)
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for cmd in (["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-N", node, "-f", str(conf)]):
            cluster.daemons.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                    stderr=open(root / "log" / f"{cmd[0]}.err", "wb")))  # noqa: SIM115
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
            if state in {"idle", "mixed", "allocated"}:
                break
            time.sleep(0.5)
        else:
            logs = "\n".join((root / "log" / n).read_text(errors="replace")[-2000:]
                             for n in ("slurmctld.log", "slurmd.log") if (root / "log" / n).exists())
            raise RuntimeError(f"slurm node never became idle (state {state!r}):\n{logs}")
        yield cluster
    finally:
        for proc in reversed(cluster.daemons):
            stop_daemon(proc, 15)
