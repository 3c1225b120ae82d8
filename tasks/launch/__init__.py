"""Multi-node launchers: one implementation per engine, picked by `cluster.launcher`.

`get_launcher(cfg).run(cfg, dataset_dir, job=JobSpec(name, output_dir))` runs
one rank job (the job's name on the engine, its directory) and returns the
ranks' summary, whichever engine runs them: `local` (`tasks.base.spawn` here), `ssh`
(one `tasks.base.spawn` per node over SSH), `slurm` (`sbatch` + `srun python -m tasks.base.spawn`),
`kubernetes` (a Kubeflow PyTorchJob). Each engine takes its typed config section
(`cluster.ssh`, `cluster.slurm`, `cluster.kubernetes`), validated at load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config.schema import JobConfig
from tasks.launch.base import Job, JobPreempted, LaunchCancelled, Launcher
from tasks.launch.outcome import Outcome
from tasks.launch.spec import JobSpec, LaunchOptions

if TYPE_CHECKING:
    from tasks.runs.identity import RunIdentity

__all__ = ["Job", "JobPreempted", "JobSpec", "Launch", "LaunchCancelled", "LaunchOptions", "Launcher", "Outcome",
           "cancel", "collect", "follow", "get_launcher", "pool_for", "train"]


@dataclass(frozen=True)
class Launch:
    """One rank job a stage starts: the config it runs under (its layout), what names it and where it writes
    (`job`), and what `Launcher.run` / `Launcher.submit` take besides."""

    cfg: JobConfig
    job: JobSpec
    dataset_dir: Path
    run: RunIdentity
    options: LaunchOptions

    def run_here(self) -> dict[str, Any]:
        """Start and supervise it from this process; its summary."""
        return get_launcher(self.cfg).run(self.cfg, self.dataset_dir, job=self.job, run=self.run,
                                          options=self.options)

    def submit(self) -> dict[str, Any]:
        """Start it and return its handle, to follow from elsewhere (`follow`, `collect`)."""
        return get_launcher(self.cfg).submit(self.cfg, self.dataset_dir, job=self.job, run=self.run,
                                             options=self.options)


async def follow(cfg: JobConfig, handle: Mapping[str, Any], *, deadline: float | None = None) -> Outcome:
    """Wait for a submitted job (see Launcher.follow); `cfg` is its config (engine, timeouts), the handle names
    the job and its directory."""
    return await get_launcher(cfg).follow(cfg, handle, deadline=deadline)


def collect(cfg: JobConfig, handle: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
    """The summary of a followed job, or the failure (see Launcher.collect)."""
    return get_launcher(cfg).collect(cfg, handle, outcome)


def cancel(cfg: JobConfig, handle: Mapping[str, Any]) -> None:
    """Stop a submitted job on every node (a killed Airflow task's trigger calls this)."""
    get_launcher(cfg).stop_job(handle)


def train(cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, run: RunIdentity | None = None,
          init_path: Path | None = None) -> dict[str, Any]:
    """Run one training job through the config's launcher, into `cfg.train.output_dir` (`init_path`: the starting
    weights a fresh run loads); the summary, or TrainingFailedError."""
    return get_launcher(cfg).run(cfg, dataset_dir, run=run, options=LaunchOptions(init_path=init_path))


def get_launcher(cfg: JobConfig, *, env: dict[str, str] | None = None) -> Launcher:
    """The launcher for `cfg.cluster.launcher`, built from its config section.

    `env`: extra environment for the processes this machine starts (the ranks, and the engine's
    client commands, e.g. SLURM_CONF); a PyTorchJob's pods get `cluster.kubernetes.env` instead.
    """
    c = cfg.cluster
    if c.launcher == "ssh":
        # lazy: only the configured engine's module (and its client library) loads
        from tasks.launch.ssh import SshLauncher

        return SshLauncher(c.ssh, env=env)
    if c.launcher == "slurm":
        # lazy: only the configured engine's module (and its client library) loads
        from tasks.launch.slurm import SlurmLauncher

        return SlurmLauncher(c.slurm, env=env)
    if c.launcher == "kubernetes":
        # lazy: only the configured engine's module (and its client library) loads
        from tasks.launch.kubernetes import KubernetesLauncher

        if env:
            raise ValueError("get_launcher: env does not reach a PyTorchJob's pods; use cluster.kubernetes.env")
        return KubernetesLauncher(c.kubernetes)
    # lazy: only the configured engine's module (and its client library) loads
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
    return name, cfg.parallel.layout.world_size
