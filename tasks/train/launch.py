"""Start training: build the `torchrun` command from the config, run it, propagate the outcome.

Why torchrun in its own process group: when the caller (an Airflow task) is
killed or times out, the whole group is killed and reaped, so no rank is left
behind. Rank output is streamed into `logging`; a failed run becomes a
`TrainingFailedError` naming the step, and leaves no `summary.json`.

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

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tasks.config import JobConfig
from tasks.errors import InvalidInputError, TrainingFailedError
from tasks.train.data import read_manifest

log = logging.getLogger(__name__)

# The worker logs "training failed: <reason>" (e.g. "non-finite loss at step 7 (nan)") before exiting 1.
_FAILED = re.compile(r"training failed: (.+)$")


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


def write_config_json(cfg: JobConfig, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="job-config.", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg.model_dump(mode="json"), fh)
    return Path(path)


def train(cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the whole training job; return the run summary, or raise TrainingFailedError."""
    from tasks.train.worker import check_layout

    check_layout(cfg)  # fail fast with a clear message, before spawning ranks
    read_manifest(dataset_dir)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)  # a stale summary must never describe this run
    config_json = write_config_json(cfg, out)
    cmd = torchrun_command(cfg, Path(dataset_dir).resolve(), config_json)
    log.info("launching %d ranks: %s", cfg.parallel.world_size, " ".join(cmd))
    failure: list[str] = []
    try:
        rc = _run_group(cmd, worker_env(env), failure)
    finally:
        config_json.unlink(missing_ok=True)
    if rc != 0:
        summary_path.unlink(missing_ok=True)
        detail = failure[0] if failure else f"torchrun exited with status {rc}"
        raise TrainingFailedError(f"training of {cfg.name} failed: {detail}")
    try:
        return json.loads(summary_path.read_text())
    except FileNotFoundError:
        raise TrainingFailedError(f"training of {cfg.name} exited 0 but wrote no {summary_path}") from None


def _run_group(cmd: list[str], env: dict[str, str], failure: list[str]) -> int:
    """Run cmd in a new session, stream its output to logging, kill the group on interrupt."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    reader = threading.Thread(target=_pump, args=(proc, failure), daemon=True)
    reader.start()
    previous = signal.getsignal(signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    try:
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        reader.join(timeout=10)
    return rc


def _pump(proc: subprocess.Popen[str], failure: list[str]) -> None:
    rank_log = logging.getLogger("tasks.train.ranks")
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        match = _FAILED.search(line)
        if match and not failure:
            failure.append(match.group(1))
        rank_log.info("%s", line)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the whole group, then SIGKILL after a grace period; always reap."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    with contextlib.suppress(ProcessLookupError):  # ranks that outlived torchrun
        os.killpg(proc.pid, signal.SIGKILL)
    log.warning("training process group %d stopped", proc.pid)
