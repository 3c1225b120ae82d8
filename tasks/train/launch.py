"""The `torchrun` invocation of the training worker, and `train()`: one run through the launcher.

Every launcher (tasks/launch: local, ssh, slurm, kubernetes) builds its per-node
command here, so the ranks start the same way everywhere; supervision (log
streaming, hang detection, cancelling every rank on SIGTERM or when the caller
dies) is the launcher's job.

DeepSpeed's CPU op JIT build is not paid per run: the optimizer is a plain
`torch.optim.AdamW` (no fused-Adam build), and the shm comm op that
`deepspeed.init_distributed` builds on CPU lands in PyTorch's persistent
extension cache (`TORCH_EXTENSIONS_DIR`, the documented torch switch, default
`~/.cache/torch_extensions/<py><cuda>`; point it at a shared or baked-in dir
in images), so it is compiled once per machine (~30-90 s) and afterwards only
loaded (about a second). DeepSpeed 0.19 has no switch that skips that op, and
we do not patch its private functions. Ranks inherit the caller's
environment, so a TORCH_EXTENSIONS_DIR set there applies to every rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tasks.config import JobConfig
from tasks.errors import InvalidInputError
from tasks.run import RunIdentity

log = logging.getLogger(__name__)

def torchrun_command(
    cfg: JobConfig,
    dataset_dir: str | os.PathLike[str],
    config_json: str | os.PathLike[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    nproc_per_node: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun invocation for one node (static rendezvous at cluster.master_addr:master_port)."""
    world = cfg.parallel.world_size
    per_node = nproc_per_node or cfg.cluster.nproc_per_node or world // nnodes
    if per_node * nnodes != world:
        raise InvalidInputError(f"cluster: {nnodes} node(s) x {per_node} processes != tp x pp x dp = {world}")
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={per_node}",
        f"--master-addr={cfg.cluster.master_addr}",
        f"--master-port={cfg.cluster.master_port}",
        "-m", "tasks.train.worker",
        "--config", str(config_json),
        "--dataset-dir", str(dataset_dir),
    ]  # fmt: skip


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the ranks: one OpenMP thread per rank on CPU, quiet tokenizers, our extras."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def write_config_json(cfg: JobConfig, directory: Path, run: RunIdentity, init_path: Path | None = None) -> Path:
    """The ranks' input: the job, the run's identity, and the local starting weights (if a fresh run loads any)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="job-config.", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as fh:
        json.dump({"job": cfg.model_dump(mode="json"), "run": run.to_dict(),
                   "init_path": str(init_path) if init_path else None}, fh)
    return Path(path)


def train(cfg: JobConfig, dataset_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Run the whole training job through the config's launcher; the summary, or TrainingFailedError."""
    from tasks.launch import get_launcher

    return get_launcher(cfg).run(cfg, dataset_dir)
