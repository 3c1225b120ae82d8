"""How every launcher starts the ranks: one node's command (torchrun's flags and rank environment, run by
`tasks.base.spawn`), the ranks' environment, their input file.

Every launcher (local, ssh, slurm, kubernetes) builds its per-node command here, so the
ranks start the same way everywhere. What reaches a rank is only what training needs:
- the worker file holds a `TrainingJob` (no data source, registry or store: no credentials),
  the run's identity and the local starting weights;
- the environment is an allow-list of the caller's (runtime, threading, NCCL/gloo, torch,
  Python, Slurm) plus the launcher's explicit extras; registry URLs, AWS keys and Airflow
  Connections in the caller's environment never reach a rank.

DeepSpeed's CPU shared-memory op is JIT-built into torch's extension cache (tasks/base/comm_ops.py loads
it on the ranks). The ranks' cache is per Python environment (`<sys.prefix>/torch-extensions`
unless TORCH_EXTENSIONS_DIR is set), so two checkouts with their own venvs never rebuild each
other's op (a shared `~/.cache/torch_extensions` alternated between them), and
`scripts/setup.sh` builds it once at install time (`prebuild_ops`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.base.comm_ops import EXTENSIONS_VAR, default_extensions_dir, load_shm_op
from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig
from tasks.launch.spec import JobSpec
from tasks.runs.identity import RunIdentity
from tasks.train.tracking import tracking_spec

# The rank modules `tasks.base.spawn` runs on every node: training and evaluation (tests swap in their hooked workers).
WORKER_MODULE = "tasks.train.worker"
EVAL_WORKER_MODULE = "tasks.evaluate.worker"
RANK_START_MODULE = "tasks.train.start"  # runs the worker module after the ranks' start-up

# The caller's environment a rank may inherit: what the runtime needs, never credentials. The portable part is
# the job's own settings (threads, glibc's allocator, NCCL/gloo, torch, Python, CUDA), which a launcher sends to
# other hosts (ssh); the rest (paths, user, locale, Slurm's step) is this host's own, which a remote node has its
# own of.
PORTABLE_ENV_NAMES = frozenset({"TP_SOCKET_IFNAME", "DS_ACCELERATOR", "THP_MEM_ALLOC_ENABLE"})
PORTABLE_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "MALLOC_", "NCCL_", "GLOO_", "TORCH_", "CUDA_", "PYTHON")
RANK_ENV_NAMES = PORTABLE_ENV_NAMES | {
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "SHELL",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "CUDA_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
}
RANK_ENV_PREFIXES = (*PORTABLE_ENV_PREFIXES, "LC_", "NVIDIA_", "SLURM_")
# What every rank gets unless the caller sets it.
# THP_MEM_ALLOC_ENABLE: torch's CPU allocator backs tensors of 2 MiB and more with transparent huge pages
# (madvise), so a rank's first touch of its host buffers (optimizer state, flat partitions, checkpoint snapshots)
# takes one page fault per 2 MiB instead of per 4 KiB: 2.4 GB first-touched in 0.25-0.5 s instead of 0.9-1.0 s.
# Progress bars (tqdm's, the datasets library's: the benchmarks' harness draws them) would reach the person as
# relayed log lines; a rank reports its progress in its status file.
RANK_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1", "TQDM_DISABLE": "1",
                     "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
# What a training rank gets besides, and an evaluation rank instead (`rank_env_defaults`).
# MALLOC_MMAP_THRESHOLD_: every block of 2 MiB and more comes from its own mmap and goes back to the kernel when
# freed. glibc's default threshold is dynamic (mallopt(3)): 128 KiB at first, raised to the size of each mmapped
# block freed, up to 32 MiB. A rank frees such blocks after its first step and save (activations, gradients, the
# checkpoint snapshot: tasks/train/async_save.py), and from then on its blocks up to 32 MiB (a Llama's weight
# matrices, their gradients and Adam moments, the snapshot's copies of them; torch asks for them 2 MiB-aligned
# with THP_MEM_ALLOC_ENABLE, which carves a bigger chunk) come from the heap and the threads' arenas, which give
# memory back only from their top: the freed holes are reused only by blocks that fit them, and the RSS climbs
# with every step and save. Measured (issue 38, `bench/soak.py`: a 51M Llama, pp=2 on CPU, 300 steps, a save every
# 10): without this the ranks' RSS after a save grew 13% and 21% from the first save to the last (peak RSS 1.59 /
# 1.72 GiB), with it 1.5% and 0.7% (peak 1.42 / 1.40 GiB, what the plan says); a 300M Llama's rank 1 peaked at
# 7.41 GiB without it, 5.64 with it (BENCHMARKS.md "Rank memory across saves"). Setting the threshold turns the
# dynamic adjustment off (and keeps the trim threshold at its 128 KiB, so the heap's top is returned; no arena
# limit was needed for that plateau); 2 MiB: where torch starts aligning blocks for huge pages. The price: each
# such block is mapped and first-touched anew (more system time per step: ~1.5% of a 300M step on CPU).
# Evaluation ranks get glibc's own ceiling instead, fixed from the start: blocks under 32 MiB from the heap and
# the heap's top returned only past 64 MiB (the dynamic threshold's maximum and its trim threshold). They live
# one evaluation and allocate the same blocks for every window (activations, logits). With the training setting
# each block of 2 MiB and more was mapped and first-touched anew every window; with glibc's dynamic default a
# stage whose freed blocks never raised the threshold (the first stage: it holds no logits) kept the 128 KiB trim
# threshold, and the heap's top was returned and grown again ~600 times a second: 117,000 page faults a second,
# 17% of the rank's time in the kernel. A bf16 stage's forward (10 blocks of bench/scale.py's 302M Llama, one
# thread) took 0.15 s with the training setting against 0.125 s; the whole evaluation 5.7 s with it, 5.2-5.6 with
# glibc's default, 5.1-5.5 with this (BENCHMARKS.md).
TRAINING_RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2 * 1024**2)}
EVALUATION_RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024**2), "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**2)}


def rank_env_defaults(evaluation: bool = False) -> dict[str, str]:
    """What every training rank, or with `evaluation` every evaluation rank, gets unless the caller sets it (a pod,
    which inherits nothing of ours, gets exactly this)."""
    return {**RANK_ENV_DEFAULTS, **(EVALUATION_RANK_ENV if evaluation else TRAINING_RANK_ENV)}


def node_command(
    cfg: JobConfig,
    dataset_dir: str | os.PathLike[str],
    config_json: str | os.PathLike[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    nproc_per_node: int | None = None,
    python: str = sys.executable,
    evaluation: bool = False,
) -> list[str]:
    """One node's command for the training ranks, or with `evaluation` the evaluation ranks: torchrun's flags
    (static rendezvous at cluster.master_addr:master_port), run by `tasks.base.spawn`, which starts the ranks
    without importing torch itself."""
    world = cfg.parallel.layout.world_size
    per_node = nproc_per_node or cfg.cluster.nproc_per_node or world // nnodes
    if per_node * nnodes != world:
        raise InvalidInputError(f"cluster: {nnodes} node(s) x {per_node} processes != tp x pp x dp = {world}")
    return [
        python, "-m", "tasks.base.spawn",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={per_node}",
        f"--master-addr={cfg.cluster.master_addr}",
        f"--master-port={cfg.cluster.master_port}",
        "-m", RANK_START_MODULE, EVAL_WORKER_MODULE if evaluation else WORKER_MODULE,
        "--config", str(config_json),
        "--dataset-dir", str(dataset_dir),
    ]  # fmt: skip


def rank_env(extra: dict[str, str] | None = None, *, evaluation: bool = False) -> dict[str, str]:
    """The ranks' environment (training ranks', or with `evaluation` evaluation ranks'): the allow-listed part of
    ours, one OpenMP thread per rank, our extras."""
    inherited = {k: v for k, v in os.environ.items() if k in RANK_ENV_NAMES or k.startswith(RANK_ENV_PREFIXES)}
    return {**rank_env_defaults(evaluation), EXTENSIONS_VAR: default_extensions_dir(), **inherited, **(extra or {})}


def portable_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a ranks' environment another host gets (see PORTABLE_ENV_*)."""
    return {k: v for k, v in env.items() if k in PORTABLE_ENV_NAMES or k.startswith(PORTABLE_ENV_PREFIXES)}


def write_worker_config(cfg: JobConfig, spec: JobSpec, run: RunIdentity, init_path: Path | None = None,
                        export: dict[str, Any] | None = None, evaluation: dict[str, Any] | None = None) -> Path:
    """The ranks' input file, in the job's directory: the training job (no credentials), the run's identity, the
    starting weights, where the final weights' export goes (store URL, staging area, dtype, options without
    credentials), for training ranks where their curves go (tasks/train/tracking.py), and for evaluation ranks
    what they evaluate (tasks/evaluate).

    The one place the ranks learn where to write: their job's `train.output_dir` is `spec.output_dir`."""
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="worker-config.", suffix=".json", dir=spec.output_dir)
    job = cfg.with_output_dir(spec.output_dir).training_job()
    with os.fdopen(fd, "w") as fh:
        json.dump({"job": job.model_dump(mode="json"), "run": run.to_dict(),
                   "init_path": str(init_path) if init_path else None, "export": export,
                   "evaluation": evaluation, "tracking": tracking_spec(cfg, run) if evaluation is None else None}, fh)
    return Path(path)


def prebuild_ops() -> str:
    """Build DeepSpeed's CPU shared-memory comm op into this environment's extension cache (setup time)."""
    os.environ.setdefault(EXTENSIONS_VAR, default_extensions_dir())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    load_shm_op()
    return os.environ[EXTENSIONS_VAR]


if __name__ == "__main__":  # `python -m tasks.launch.torchrun --prebuild` (scripts/setup.sh)
    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m tasks.launch.torchrun --prebuild")
    print(f"DeepSpeed ops built into {prebuild_ops()}")
