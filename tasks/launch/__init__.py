"""Multi-node launchers: one implementation per engine, picked by `cluster.launcher`.

`get_launcher(cfg).run(cfg, dataset_dir)` trains and returns the trainer's
summary, whichever engine runs the ranks: `local` (torchrun here), `ssh`
(torchrun per node over SSH), `slurm` (`sbatch` + `srun torchrun`),
`kubernetes` (a Kubeflow PyTorchJob). Each engine takes its typed config section
(`cluster.ssh`, `cluster.slurm`, `cluster.kubernetes`), validated at load.
"""

from __future__ import annotations

import os
from typing import Any

from tasks.config import JobConfig
from tasks.launch.base import Job, LaunchCancelled, Launcher

__all__ = ["Job", "LaunchCancelled", "Launcher", "get_launcher", "pool_for", "train"]


def train(cfg: JobConfig, dataset_dir: str | os.PathLike[str], **run: Any) -> dict[str, Any]:
    """Run one training job through the config's launcher; the summary, or TrainingFailedError."""
    return get_launcher(cfg).run(cfg, dataset_dir, **run)


def get_launcher(cfg: JobConfig, *, env: dict[str, str] | None = None) -> Launcher:
    """The launcher for `cfg.cluster.launcher`, built from its config section.

    `env`: extra environment for the processes this machine starts (the ranks, and the engine's
    client commands, e.g. SLURM_CONF); a PyTorchJob's pods get `cluster.kubernetes.env` instead.
    """
    c = cfg.cluster
    if c.launcher == "ssh":
        from tasks.launch.ssh import SshLauncher

        return SshLauncher(c.ssh, env=env)
    if c.launcher == "slurm":
        from tasks.launch.slurm import SlurmLauncher

        return SlurmLauncher(c.slurm, env=env)
    if c.launcher == "kubernetes":
        from tasks.launch.kubernetes import KubernetesLauncher

        if env:
            raise ValueError("get_launcher: env does not reach a PyTorchJob's pods; use cluster.kubernetes.env")
        return KubernetesLauncher(c.kubernetes)
    from tasks.launch.local import LocalLauncher

    return LocalLauncher(env=env)


def pool_for(cfg: JobConfig) -> tuple[str, int]:
    """The Airflow pool a training of this config occupies, and how many slots (its world size).

    One pool per cluster (`training-<launcher>[-<partition|namespace>]`) sized in GPU slots caps
    concurrent trainings on that cluster; a job takes as many slots as it has ranks.
    """
    c = cfg.cluster
    where = {"slurm": c.partition, "kubernetes": c.namespace}.get(c.launcher)
    name = f"training-{c.launcher}" + (f"-{where}" if where else "")
    return name, cfg.parallel.world_size
