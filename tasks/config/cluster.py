"""The `cluster` section: where the ranks run (local, ssh hosts, Slurm, Kubernetes) and with what."""

from __future__ import annotations

import hashlib
import re
import sys
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)

from tasks import REPO_ROOT
from tasks.config.bounds import MAX_RANKS, MAX_WAIT_S, Strict

# A Kubernetes resource.Quantity ("8", "500m", "64Gi"), as the PyTorchJob CRD checks it (tasks/launch/k8s_schema).
K8S_QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?"
                        r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # a DNS-1123 subdomain
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_LOGIN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"  # never a leading "-": ssh would read it as an option
_HOST = r"^[A-Za-z0-9_\[][A-Za-z0-9_.:%\[\]-]*$"
# sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (fields after the first below 60, hours after D- below 24).
_SLURM_TIME = re.compile(r"^(?:\d+-(?:[01]?\d|2[0-3])(?::[0-5]?\d){0,2}|\d+(?::[0-5]?\d){0,2})$")
# Planner fields renamed so the unit is in the name; an old name is refused with its new one.
_RENAMED = {
    "gpu_memory_gb": "gpu_memory_gib (GiB per GPU)",
    "intra_node_gbps": "intra_node_gbytes_per_s (GB/s per GPU inside a node)",
    "inter_node_gbps": "inter_node_gbytes_per_s (GB/s per node between nodes), or inter_node_gbits_per_s "
                       "(Gbit/s per node, as NICs are sold)",
}


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must be an absolute path, got {path!r}")
    return path


def _quantity(value: str) -> str:
    if not re.fullmatch(K8S_QUANTITY_PATTERN, value):
        raise ValueError(f'not a Kubernetes quantity ({value!r}): e.g. "8", "500m", "64Gi"')
    return value


AbsolutePath = Annotated[str, AfterValidator(_absolute)]
Quantity = Annotated[str, AfterValidator(_quantity)]


class SshConfig(Strict):
    """`ssh` engine: how each host in `cluster.hosts` is reached, and what runs there."""

    user: str | None = Field(None, pattern=_LOGIN, description="login user; None: ssh's default")
    port: int = Field(22, ge=1, le=65535)
    identity_file: str | None = Field(None, min_length=1, description="private key (with IdentitiesOnly=yes)")
    ssh_options: tuple[str, ...] = Field((), description="extra `-o Key=Value` options")
    python: str = Field(default_factory=lambda: sys.executable, min_length=1, description="interpreter on every node")
    workdir: AbsolutePath = Field(str(REPO_ROOT), description="the repository on every node (shared filesystem)")
    connect_timeout_s: int = Field(10, ge=1, le=MAX_WAIT_S, description="ssh ConnectTimeout (whole seconds)")
    grace_s: float = Field(15.0, gt=0, le=MAX_WAIT_S, description="SIGTERM-to-SIGKILL grace when a node is stopped")

    @field_validator("ssh_options")
    @classmethod
    def _key_value(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        bad = [o for o in options if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*[= ]\S.*", o)]
        if bad:
            raise ValueError(f"each option must be Key=Value (as for ssh -o), got {bad}")
        return options


class SlurmConfig(Strict):
    """`slurm` engine: the allocation `sbatch` asks for."""

    nodes: int = Field(1, ge=1, le=MAX_RANKS)
    time_limit: str = Field("24:00:00", description="sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S")
    gpus_per_node: int | None = Field(None, ge=1, le=MAX_RANKS,
                                      description="sbatch --gpus-per-node; None: not requested")
    sbatch_args: tuple[str, ...] = Field((), description="extra #SBATCH lines, e.g. --account=ml")
    python: str = Field(default_factory=lambda: sys.executable, min_length=1, description="interpreter on every node")
    workdir: AbsolutePath = Field(str(REPO_ROOT), description="the repository on every node (shared filesystem)")
    cancel_timeout_s: float = Field(180.0, gt=0, le=MAX_WAIT_S,
                                    description="how long scancel may take to end every step")
    qos: str | None = Field(None, pattern=r"^[-_.a-zA-Z0-9]+$", description="sbatch --qos (how most sites rank "
                            "jobs: e.g. a high-priority QoS for production retrains)")
    job_priority: bool = Field(False, description="also pass schedule.priority as sbatch --priority (needs Slurm "
                               "operator rights, which most users lack: QoS is the usual way)")

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if value.upper() not in ("UNLIMITED", "INFINITE") and not _SLURM_TIME.fullmatch(value):
            raise ValueError(f"not a Slurm time ({value!r}): use M, M:S, H:M:S, D-H, D-H:M or D-H:M:S, "
                             "e.g. 90, 02:00:00, 1-12")
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        bad = [a for a in args if not a.startswith("-") or "\n" in a]
        if bad:
            raise ValueError(f"each entry is one sbatch option starting with '-', on one line, got {bad}")
        return args


class SecretRef(Strict):
    """One key of a Kubernetes Secret, read into an environment variable by the kubelet."""

    secret: str = Field(pattern=K8S_NAME_PATTERN, max_length=253)
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)


class KubernetesConfig(Strict):
    """`kubernetes` engine: the PyTorchJob's pods."""

    nodes: int = Field(1, ge=1, le=MAX_RANKS, description="pods: one Master plus nodes - 1 Workers")
    gpus_per_node: int | None = Field(None, ge=0, le=MAX_RANKS,
                                      description="nvidia.com/gpu per pod; None: one per rank, 0: none")
    cpu: Quantity | None = Field(None, description='cpu limit (and request) per pod, e.g. "8"')
    memory: Quantity | None = Field(None, description='memory limit (and request) per pod, e.g. "64Gi"')
    output_claim: str = Field("retrainer-output", pattern=K8S_NAME_PATTERN, max_length=253,
                              description="PVC mounted at train.output_dir")
    cache_volume: Literal["host_path", "claim", "ephemeral"] = Field(
        "host_path", description="what backs data.cache_dir in each pod: the node's directory (cache_host_path), "
                                 "a PersistentVolumeClaim (cache_claim, e.g. a local PV) or an emptyDir")
    cache_host_path: AbsolutePath | None = Field(None, description="node directory for data.cache_dir; "
                                                 "None: the same path")
    cache_claim: str | None = Field(None, pattern=K8S_NAME_PATTERN, max_length=253,
                                    description="PVC for data.cache_dir when cache_volume is 'claim'")
    python: str = Field("python", min_length=1, description="interpreter in the image")
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(
        default_factory=dict, description="plain (non-secret) environment of the pods")
    env_from_secrets: dict[Annotated[str, Field(pattern=_ENV_NAME)], SecretRef] = Field(
        default_factory=dict, description="ENV_NAME: {secret, key}, rendered as valueFrom.secretKeyRef")
    service_account: str | None = Field(None, pattern=K8S_NAME_PATTERN, max_length=253)
    kube_context: str | None = Field(None, min_length=1, description="kubeconfig context; in-cluster config first")
    cancel_timeout_s: float = Field(300.0, gt=0, le=MAX_WAIT_S,
                                    description="how long the pods may take to go after delete")
    priority_class_name: str | None = Field(None, pattern=K8S_NAME_PATTERN, max_length=253,
                                            description="pods' priorityClassName (preemption order on the cluster)")
    kueue_queue: str | None = Field(None, pattern=K8S_NAME_PATTERN, max_length=253,
                                    description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name): the job waits "
                                    "in Kueue's queue, admitted by quota and priority")

    @model_validator(mode="after")
    def _env_once(self) -> KubernetesConfig:
        if self.cache_volume == "claim" and not self.cache_claim:
            raise ValueError("cluster.kubernetes.cache_volume 'claim' needs cluster.kubernetes.cache_claim")
        both = sorted(set(self.env) & set(self.env_from_secrets))
        if both:
            raise ValueError(f"cluster.kubernetes.env and env_from_secrets both set {both}; keep each in one place")
        return self


class ClusterConfig(Strict):
    """Where the ranks run (`launcher` and its section) and the hardware the planner budgets for.

    Only the section of the chosen launcher is used; a config may carry others. On CPU under
    `local` a "GPU" is one rank process: `gpus_per_node` caps the ranks this machine runs and
    `gpu_memory_gib` is each rank's memory budget.
    """

    launcher: Literal["local", "ssh", "slurm", "kubernetes"] = "local"
    nproc_per_node: int | None = Field(None, ge=1, le=MAX_RANKS, description="ranks per node; unset: tp x pp x dp / "
                                       "nodes, which the planner requires to be gpus_per_node (whole nodes)")
    hosts: list[Annotated[str, Field(pattern=_HOST)]] = Field(default_factory=list,
                                                              description="ssh: one host per node")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, gt=0, lt=65536, description="rank rendezvous port (default: from the job's "
                             "name, see default_master_port)")
    partition: str | None = None
    namespace: str = "default"
    image: str | None = None
    hang_timeout_s: float = Field(600.0, gt=0, le=MAX_WAIT_S)
    deferrable: bool | None = Field(None, description="the Airflow task submits the job and defers while it runs "
                                    "(no worker held); None: yes for slurm and kubernetes, whose jobs outlive "
                                    "the task, no for local and ssh, whose ranks die with it")
    startup_timeout_s: float | None = Field(None, gt=0, le=MAX_WAIT_S, description="allowance before the first "
                                            "step of a launch (imports, rendezvous, op builds); None: hang_timeout_s")
    ssh: SshConfig = SshConfig()
    slurm: SlurmConfig = SlurmConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    # Hardware, for the planner.
    device: Literal["auto", "gpu", "cpu"] = Field(
        "auto", description="what the ranks compute on, for the planner (precision auto, host vs device memory); "
        "auto: the GPUs the engine asks for (kubernetes.gpus_per_node: unset = one per rank, 0 = none; "
        "slurm.gpus_per_node set), else what the planning machine sees (right for local; for ssh hosts or a "
        "Slurm partition that gives GPUs without --gpus-per-node, say gpu). The ranks refuse a node that "
        "is not what this names")
    gpu_memory_gib: float = Field(80.0, gt=0, description="GiB per GPU")
    host_memory_gib: float | None = Field(None, gt=0, description="GiB of host RAM per node: the process memory of "
                                          "a node's ranks together (on GPUs their runtime and every save's host "
                                          "snapshot; on CPU everything) must fit it; unset: not checked")
    gpus_per_node: int = Field(8, ge=1, le=MAX_RANKS, description="GPUs in one node: the planner's node size (the "
                               "engine sections' gpus_per_node is what a job asks for)")
    intra_node_gbytes_per_s: float = Field(450.0, gt=0, description="GB/s per GPU inside a node (NVLink)")
    inter_node_gbytes_per_s: float | None = Field(None, gt=0, description="GB/s per node between nodes; "
                                                  "default 50 (or give inter_node_gbits_per_s)")
    inter_node_gbits_per_s: float | None = Field(None, gt=0, description="Gbit/s per node, as NICs are sold")
    peak_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per GPU")
    assumed_mfu: float = Field(0.4, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        old = [name for name in _RENAMED if isinstance(data, dict) and name in data]
        if old:
            raise ValueError("; ".join(f"cluster.{name} was renamed to cluster.{_RENAMED[name]}" for name in old))
        return data

    @model_validator(mode="after")
    def _deferrable_engine(self) -> ClusterConfig:
        if self.deferrable and self.launcher in ("local", "ssh"):
            raise ValueError(f"cluster.deferrable: the {self.launcher} launcher's ranks die with the process that "
                             "started them (by design: a killed task takes its ranks along), so its task cannot "
                             "defer; use slurm or kubernetes, or deferrable: false")
        return self

    @property
    def ranks_device(self) -> tuple[Literal["gpu", "cpu"], str] | None:
        """(what the ranks compute on, the field that says so) as far as the config tells: `device`, else the
        engine's GPU request; None: only the machine the ranks run on can tell (local, ssh, Slurm without a GPU
        request)."""
        if self.device != "auto":
            return self.device, "cluster.device"
        if self.launcher == "kubernetes":
            return "cpu" if self.kubernetes.gpus_per_node == 0 else "gpu", "cluster.kubernetes.gpus_per_node"
        if self.launcher == "slurm" and self.slurm.gpus_per_node is not None:
            return "gpu", "cluster.slurm.gpus_per_node"
        return None

    @property
    def defers(self) -> bool:
        """Whether the Airflow task defers while the job runs (see `deferrable`)."""
        return self.launcher in ("slurm", "kubernetes") if self.deferrable is None else self.deferrable

    @model_validator(mode="after")
    def _one_inter_node_unit(self) -> ClusterConfig:
        if self.inter_node_gbytes_per_s is not None and self.inter_node_gbits_per_s is not None:
            raise ValueError("set one of cluster.inter_node_gbytes_per_s (GB/s) and cluster.inter_node_gbits_per_s "
                             "(Gbit/s), not both")
        return self

    @property
    def inter_node_bytes_per_s(self) -> float:
        """Bytes/s per node between nodes, from whichever unit the config gave (default 50 GB/s)."""
        if self.inter_node_gbits_per_s is not None:
            return self.inter_node_gbits_per_s * 1e9 / 8
        return (50.0 if self.inter_node_gbytes_per_s is None else self.inter_node_gbytes_per_s) * 1e9


MASTER_PORTS = range(20000, 30000)  # under Linux's ephemeral ports (32768+), which the OS hands out


def default_master_port(name: str) -> int:
    """The rank rendezvous port of a model that names none: sha256 of its name into MASTER_PORTS, the same on
    every machine and run; two names share one with odds 1 in 10000."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return MASTER_PORTS[digest % len(MASTER_PORTS)]
