"""Per-step telemetry (JSON lines): loss, throughput, measured compute vs communication, memory, MFU.

Why measured: the planner's communication estimates are checked against these
numbers. Communication time is what DeepSpeed's comms logger times around every
`deepspeed.comm` collective and p2p op of this rank (the TP all-reduces of our
layers go through it too). It includes waiting inside a collective (pipeline
bubbles, stragglers), which is what a step loses to communication. The logger
synchronizes the device after each op: a small cost on GPU, none on CPU.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

COMM_WARN_FRACTION = 0.2


def comms_config() -> dict[str, Any]:
    """DeepSpeed config section that turns on per-op communication timing."""
    return {"enabled": True, "prof_all": True, "verbose": False, "debug": False}


def take_comm_seconds() -> float:
    """Communication seconds recorded since the last call (and reset the counters)."""
    from deepspeed.comm import comm as ds_comm

    logger = ds_comm.comms_logger
    total_ms = 0.0
    for name in list(logger.comms_dict):
        total_ms += ds_comm.timers(name).elapsed(reset=True)
    logger.reset_data()
    return total_ms / 1000.0


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def flops_per_token(n_params: int, n_layers: int, seq_len: int, d_model: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention scores (PaLM appendix B)."""
    return 6.0 * n_params + 12.0 * n_layers * seq_len * d_model


class Telemetry:
    """Rank 0 appends one JSON line per step; warns when communication exceeds 20% of a step."""

    def __init__(self, path: Path, *, enabled: bool, fresh: bool, tokens_per_step: int,
                 flops_per_token: float, peak_flops_total: float | None) -> None:
        self.path, self.enabled = path, enabled
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self._warned_at = -10**9
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "w" if fresh else "a")  # noqa: SIM115 (kept open for the run)

    def start(self) -> float:
        take_comm_seconds()  # drop anything before the step (checkpoint I/O barriers etc.)
        return time.perf_counter()

    def record(self, step: int, loss: float, started: float) -> dict[str, Any]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s = time.perf_counter() - started
        comm_s = min(take_comm_seconds(), step_s)
        tokens_per_s = self.tokens_per_step / step_s
        row: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "compute_s": step_s - comm_s,
            "comm_s": comm_s,
            "peak_mem_bytes": peak_memory_bytes(),
            "mfu": (tokens_per_s * self.flops_per_token / self.peak_flops_total) if self.peak_flops_total else None,
        }
        if self.enabled:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
            if comm_s > COMM_WARN_FRACTION * step_s and step - self._warned_at >= 10:
                self._warned_at = step
                log.warning(
                    "step %d: communication %.1f%% of the step (%.3fs of %.3fs) exceeds %d%%: layout may be wrong",
                    step, 100 * comm_s / step_s, comm_s, step_s, int(COMM_WARN_FRACTION * 100),
                )
        return row

    def close(self) -> None:
        if self.enabled:
            self._fh.close()
