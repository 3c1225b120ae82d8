"""Fixtures for launcher tests: two "hosts" (network namespaces, each with its own sshd) and a
single-node Slurm (munged + slurmctld + slurmd on private ports and dirs). All real daemons; all torn
down even when a test fails."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.services import require, require_binary, stop_daemon
from tests.slurm import SlurmCluster
from tests.train.conftest import tiny_config, write_dataset

__all__ = ["NetnsHosts", "SlurmCluster", "tiny_config", "write_dataset"]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _wait_port(addr: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=1):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {addr}:{port} after {timeout_s}s")


@dataclass
class NetnsHosts:
    """Two network namespaces on one bridge, each running sshd (root login by a generated key).

    Each host also has its own mount namespace in which its private directory `host_caches[i]` is mounted
    at `node_cache`: a job whose `data.cache_dir` is `node_cache` fills each host's own disk, as on real
    machines (here, outside the hosts, `node_cache` is a third, empty directory). Likewise
    `host_runs[i]` at `node_run`: a job whose output dir is `node_run` keeps its whole run directory
    (checkpoints, status, summary) on each host's own disk."""

    root: Path
    names: list[str]
    addrs: list[str]
    key: Path
    bridge: str
    service_addr: str  # a second address of the bridge, for servers the hosts reach (S3)
    sshd: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def node_cache(self) -> Path:
        return self.root / "node-cache"

    @property
    def host_caches(self) -> list[Path]:
        return [self.root / f"host{i}-cache" for i in range(len(self.names))]

    @property
    def node_run(self) -> Path:
        return self.root / "node-run"

    @property
    def host_runs(self) -> list[Path]:
        return [self.root / f"host{i}-run" for i in range(len(self.names))]

    def overrides(self) -> dict[str, object]:
        """The config of an ssh job on these hosts (dotted overrides)."""
        return {
            "cluster.launcher": "ssh", "cluster.hosts": self.addrs, "cluster.master_addr": self.addrs[0],
            "cluster.ssh.user": "root", "cluster.ssh.identity_file": str(self.key),
            "cluster.ssh.ssh_options": ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null"],
        }

    @property
    def env(self) -> dict[str, str]:
        """The ranks' gloo traffic must use the namespaces' interface."""
        return {"GLOO_SOCKET_IFNAME": "rt0"}

    def pids(self, i: int) -> set[int]:
        """Every process whose network namespace is host i's (its process table, from outside)."""
        out = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, check=True)
        return {int(p) for p in out.stdout.split()}

    def training_pids(self, i: int) -> list[int]:
        """Processes on host i other than its sshd listener: what a job leaves behind."""
        return sorted(self.pids(i) - {self.sshd[i].pid})

    def left_behind(self, timeout_s: float = 15.0) -> list[int]:
        """What a finished job left on either host, once the hosts' sshd sessions of its closed channels had
        `timeout_s` to exit (they outlive the ssh client on this side by a moment)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.training_pids(0) + self.training_pids(1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def _netns_hosts(root: Path) -> Iterator[NetnsHosts]:
    suffix = uuid.uuid4().hex[:6]
    net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    names = [f"rt-{suffix}-{i}" for i in (1, 2)]
    hosts = NetnsHosts(root=root, names=names, addrs=[f"{net}.{i}" for i in (1, 2)], key=root / "id_ed25519",
                       bridge=f"rtb{suffix}", service_addr=f"{net}.253")
    made_ns: list[str] = []
    root.mkdir(parents=True, exist_ok=True)
    try:
        _sh("ip", "link", "add", hosts.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{net}.254/24", "dev", hosts.bridge)
        _sh("ip", "addr", "add", f"{hosts.service_addr}/32", "dev", hosts.bridge)
        _sh("ip", "link", "set", hosts.bridge, "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hosts.key))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key"))
        shutil.copy(root / "id_ed25519.pub", root / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for i, (ns, addr) in enumerate(zip(names, hosts.addrs, strict=True), start=1):
            veth = f"rtv{suffix}{i}"
            _sh("ip", "netns", "add", ns)
            made_ns.append(ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "rt0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", hosts.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "rt0")
            _sh("ip", "-n", ns, "link", "set", "rt0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            conf = root / f"sshd_{i}.conf"
            conf.write_text("\n".join([
                "Port 22", f"ListenAddress {addr}", f"HostKey {root / 'host_key'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                f"PidFile {root / f'sshd_{i}.pid'}", "LogLevel ERROR", "",
            ]))
            log = open(root / f"sshd_{i}.log", "wb")  # noqa: SIM115 (owned by the daemon)
            private, run_dir = hosts.host_caches[i - 1], hosts.host_runs[i - 1]
            for path in (private, run_dir, hosts.node_cache, hosts.node_run):
                path.mkdir(parents=True, exist_ok=True)
            sshd = shutil.which("sshd") or "/usr/sbin/sshd"
            # exec all the way down: the Popen pid is the sshd listener's
            start = (f"mount --bind {private} {hosts.node_cache} && mount --bind {run_dir} {hosts.node_run} "
                     f"&& exec {sshd} -D -e -f {conf}")
            hosts.sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation",
                                                "private", "sh", "-c", start], stdout=log, stderr=log))
        for addr in hosts.addrs:
            _wait_port(addr, 22)
        yield hosts
    finally:
        for proc in hosts.sshd:
            stop_daemon(proc, 10)
        for i, ns in enumerate(made_ns):  # nothing may outlive the fixture in a namespace
            leftovers = hosts.pids(i) if ns in made_ns else set()
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", hosts.bridge], capture_output=True)


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsHosts]:
    require(os.geteuid() == 0, "root (ip netns, sshd)")
    for binary in ("ip", "sshd", "ssh", "ssh-keygen"):
        require_binary(binary)
    yield from _netns_hosts(tmp_path_factory.mktemp("netns"))
