"""Per-step telemetry (JSON lines): loss, throughput, measured compute vs communication, memory, MFU; and each
step's numbers as the trackers name them.

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
import time
from pathlib import Path
from typing import Any

import torch

from tasks.config.duration import format_duration
from tasks.train.memory_trace import peak_rss_bytes

log = logging.getLogger(__name__)

COMM_WARN_FRACTION = 0.2
COMM_WARN_WINDOW = 20  # steps the share must stay above the threshold before the one warning
MAX_PROGRESS_LINES = 20  # a run logs about this many progress lines, however long it is


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
    return peak_rss_bytes()


class Telemetry:
    """Rank 0 appends one JSON line per step, logs a progress line every few steps (tokens/s, ETA), and
    warns once if communication stays above 20% of the step for a whole window of steps."""

    def __init__(self, path: Path, *, enabled: bool, fresh: bool, tokens_per_step: int,
                 flops_per_token: float, peak_flops_total: float | None, steps: int, first_step: int = 1) -> None:
        self.path, self.enabled = path, enabled
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.steps, self.first_step = steps, first_step
        self.every = max(1, (steps - first_step + 1) // MAX_PROGRESS_LINES)
        self._window: list[tuple[float, float]] = []  # (comm_s, step_s) of the last steps
        self._warned = False
        self._t_start = time.perf_counter()
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "w" if fresh else "a")  # noqa: SIM115 (kept open for the run)

    def start(self) -> float:
        take_comm_seconds()  # drop anything before the step (checkpoint I/O barriers etc.)
        return time.perf_counter()

    def record(self, step: int, loss: float, started: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """`extra`, added to the step's row: a chat run's trained (assistant) tokens and packed efficiency (real
        tokens / window tokens); a mixture of experts' `expert_load` per MoE layer; a CPU rank's `snapshot_wait_s`,
        the part of the step spent waiting for a checkpoint snapshot to be written (tasks/train/checkpointer.py)."""
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
            **(extra or {}),
        }
        if self.enabled:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
            self._progress(row)
            self._comm_window(step, comm_s, step_s)
        return row

    def _progress(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if (step - self.first_step) % self.every and step != self.steps:
            return
        done = step - self.first_step + 1
        eta = (time.perf_counter() - self._t_start) / done * (self.steps - step)
        mfu = f", MFU {row['mfu']:.0%}" if row["mfu"] is not None else ""
        log.info("step %d/%d (%d%%): loss %.4f, %.0f tokens/s%s, ETA %s", step, self.steps,
                 100 * step // self.steps, row["loss"], row["tokens_per_s"], mfu, format_duration(eta))

    def _comm_window(self, step: int, comm_s: float, step_s: float) -> None:
        self._window = [*self._window, (comm_s, step_s)][-COMM_WARN_WINDOW:]
        if self._warned or len(self._window) < COMM_WARN_WINDOW:
            return
        comm, total = sum(c for c, _ in self._window), sum(t for _, t in self._window)
        if all(c > COMM_WARN_FRACTION * t for c, t in self._window):
            self._warned = True
            log.warning("communication was %.0f%% of every step over steps %d-%d (%.3fs of %.3fs per step, "
                        "threshold %d%%): the layout may be wrong for these links (see `retrainer plan`)",
                        100 * comm / total, step - COMM_WARN_WINDOW + 1, step, comm / COMM_WARN_WINDOW,
                        total / COMM_WARN_WINDOW, int(COMM_WARN_FRACTION * 100))

    def close(self) -> None:
        if self.enabled:
            self._fh.close()


def step_metrics(row: dict[str, Any], lr: float, grad_norm: float | None, stall_s: float | None) -> dict[str, Any]:
    """One step's numbers as the trackers name them (tasks/train/tracking.py): the telemetry row with the learning
    rate, the gradient norm and, at a checkpoint, how long the save blocked training (None: not measured); on a CPU
    rank, how long the step waited for the last save's snapshot to be written."""
    metrics = {"train/loss": row["loss"], "train/lr": lr, "train/grad_norm": grad_norm,
               "train/tokens_per_s": row["tokens_per_s"], "train/mfu": row["mfu"], "train/step_s": row["step_s"],
               "train/comm_s": row["comm_s"], "train/peak_mem_bytes": row["peak_mem_bytes"],
               "checkpoint/stall_s": stall_s, "checkpoint/snapshot_wait_s": row.get("snapshot_wait_s")}
    for layer, load in row.get("expert_load", {}).items():  # 1.0 each: balanced; max >> 1: a collapsing router
        metrics[f"moe/layer_{layer}/max_load"] = load["max"] / load["mean"]
        metrics[f"moe/layer_{layer}/min_load"] = load["min"] / load["mean"]
    return metrics
