"""Asynchronous checkpoints: the rank snapshots its state to host memory and trains on while a thread
writes it and commits it with the usual protocol (tasks/train/checkpoint.py).

Why: at scale a synchronous save stops every GPU for the whole write (and the mirror upload). Here the
training thread only copies DeepSpeed's state dicts to host memory (a checkpoint engine that keeps what
DeepSpeed asks it to save) and the RNG states + data position of that moment; one background thread per
rank writes the files, fsyncs, commits and mirrors. At most one save is in flight: the next save, and the
end of training, wait for it (a CPU rank waits for the files' write before a step's optimizer step too:
tasks/train/checkpointer.py). Its error is raised on the training thread at the next step or save, so it
is never lost. The ranks' background threads agree over their own gloo group, apart from training's.

A rank that waits for the write before it changes its state (a CPU rank) copies only what the write could not
take where it lives: a tensor that fills its own storage (the fp32 master, Adam's moments) is written from the
live tensor, which nothing changes before the wait; a view into a larger buffer (the weights, views of ZeRO's
flat buffer) is copied out, because torch.save writes a tensor's whole storage. On the 300M Llama that is 4 of
the snapshot's 16 bytes a parameter (issue 38: rank 1 held 2.2 GB of snapshot beside 2.8 GB of training state).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from tasks.base.errors import TrainingFailedError

log = logging.getLogger(__name__)


# ZeRO pads the end of a partition to a multiple of 2 x dp elements (`groups_padding`): 64 KiB covers dp = 8192 in
# fp32. A tensor whose storage holds no more than this beyond it is written as it lives (padding included).
PADDING_SLACK_BYTES = 64 * 1024


def fills_its_storage(tensor: torch.Tensor) -> bool:
    """Whether torch.save, which writes a tensor's whole storage, writes (up to padding) only this tensor."""
    extra = tensor.untyped_storage().nbytes() - tensor.numel() * tensor.element_size()
    return tensor.storage_offset() == 0 and extra <= PADDING_SLACK_BYTES


def to_host(obj: Any, keep_host_tensors: bool = False) -> Any:
    """A (nested) state dict whose tensors live in host memory, detached from the live ones: copies, or with
    `keep_host_tensors` (the caller changes none of them until the write ends) the host tensors that fill
    their storage as they are."""
    if isinstance(obj, torch.Tensor):
        if keep_host_tensors and obj.device.type == "cpu" and fills_its_storage(obj):
            return obj.detach()
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = to_host(value, keep_host_tensors)
        return out
    if isinstance(obj, list):
        return [to_host(v, keep_host_tensors) for v in obj]
    if isinstance(obj, tuple):  # also torch.Size and named tuples, kept as their own type
        items = [to_host(v, keep_host_tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def write_file(path: str, state: Any) -> None:
    """One snapshotted file (the commit fsyncs the whole checkpoint directory)."""
    torch.save(state, path)


def write_files(files: list[tuple[str, Any]]) -> None:
    """Write a snapshot's files in turn, letting each one's host copy go once it is written: the snapshot shrinks
    as it is written and is gone before the commit and the mirror's upload (it stayed whole in host memory until
    the upload ended, minutes at scale). Empties `files`, also when a write fails."""
    try:
        while files:
            write_file(*files.pop(0))
    finally:
        files.clear()


class SnapshotEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine that snapshots instead of writing (`take()` hands the files over), and
    maps instead of reading. `keep_host_tensors`: the rank changes none of its state until the snapshot is written
    (see the module docstring)."""

    def __init__(self, keep_host_tensors: bool = False) -> None:
        super().__init__()
        self.keep_host_tensors = keep_host_tensors
        self.pending: list[tuple[str, Any]] = []

    def save(self, state_dict: Any, path: str) -> None:
        self.pending.append((path, to_host(state_dict, self.keep_host_tensors)))

    def load(self, path: str, map_location: Any = None) -> Any:
        """A resume maps each file instead of reading it into fresh buffers: every tensor is copied once, from
        the page cache into the engine's parameter or optimizer state (a private mapping: a tensor DeepSpeed
        keeps and updates gets pages of its own)."""
        return torch.load(path, map_location=map_location, weights_only=False, mmap=True)

    def preserves_storage_sharing(self) -> bool:
        return False  # to_host copies each view alone: DeepSpeed need not clone first

    def take(self) -> list[tuple[str, Any]]:
        files, self.pending = self.pending, []
        return files


class BackgroundSaver:
    """One save in flight at most; its failure surfaces on the training thread."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
        self.inflight: Future[None] | None = None

    def submit(self, job: Callable[[], None]) -> float:
        """Start `job` after the previous save finished; returns the seconds spent waiting for that one."""
        waited = self.wait()
        self.inflight = self.pool.submit(job)
        return waited

    def wait(self) -> float:
        """Block until the save in flight is committed (raising its error); the seconds blocked."""
        started = time.perf_counter()
        job, self.inflight = self.inflight, None
        if job is not None:
            self._raise(job)
        return time.perf_counter() - started

    def drain(self) -> None:
        """On the way out of a failed run: let the save in flight commit (it is a good checkpoint to resume
        from); its own error is only logged, the run's failure is the one reported."""
        try:
            self.wait()
        except TrainingFailedError as exc:
            log.error("%s", exc)

    def check(self) -> None:
        """Raise the error of a finished background save, if any (non-blocking)."""
        if self.inflight is not None and self.inflight.done():
            job, self.inflight = self.inflight, None
            self._raise(job)

    @staticmethod
    def _raise(job: Future[None]) -> None:
        exc = job.exception()
        if exc is None:
            return
        if isinstance(exc, TrainingFailedError):
            raise exc
        raise TrainingFailedError(f"background checkpoint save failed: {type(exc).__name__}: {exc}") from exc
