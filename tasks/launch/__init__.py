"""Multi-node launchers: one implementation per engine, picked by `cluster.launcher`.

`get_launcher(cfg).run(cfg, dataset_dir)` trains and returns the trainer's
summary, whichever engine runs the ranks: `local` (torchrun here), `ssh`
(torchrun per node over SSH), `slurm` (`sbatch` + `srun torchrun`),
`kubernetes` (a Kubeflow PyTorchJob). Engine options the config does not carry
yet are keyword arguments of the launcher classes.
"""

from __future__ import annotations

from typing import Any

from tasks.config import JobConfig
from tasks.errors import InvalidInputError
from tasks.launch.base import Job, LaunchCancelled, Launcher

__all__ = ["Job", "LaunchCancelled", "Launcher", "get_launcher", "pool_for"]


def get_launcher(cfg: JobConfig, **options: Any) -> Launcher:
    """The launcher for `cfg.cluster.launcher`; `options` go to its constructor."""
    kind = cfg.cluster.launcher
    if kind == "local":
        from tasks.launch.local import LocalLauncher

        return LocalLauncher(**options)
    if kind == "ssh":
        from tasks.launch.ssh import SshLauncher

        return SshLauncher(**options)
    if kind == "slurm":
        from tasks.launch.slurm import SlurmLauncher

        return SlurmLauncher(**options)
    if kind == "kubernetes":
        from tasks.launch.kubernetes import KubernetesLauncher

        return KubernetesLauncher(**options)
    raise InvalidInputError(f"cluster.launcher: unknown launcher {kind!r}")


def pool_for(cfg: JobConfig) -> tuple[str, int]:
    """The Airflow pool a training of this config occupies, and how many slots (its world size).

    One pool per cluster (`training-<launcher>[-<partition|namespace>]`) sized in GPU slots caps
    concurrent trainings on that cluster; a job takes as many slots as it has ranks.
    """
    c = cfg.cluster
    where = {"slurm": c.partition, "kubernetes": c.namespace}.get(c.launcher)
    name = f"training-{c.launcher}" + (f"-{where}" if where else "")
    return name, cfg.parallel.world_size
