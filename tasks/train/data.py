"""Token windows from warmed dataset dirs, and a sampler that is a pure function of the step.

Why a pure function: resume must continue on exactly the samples an unbroken
run would have seen. The global batch of step s is drawn from a permutation
seeded by (seed, epoch) with epoch = s // steps_per_epoch, so the "data
position" saved in a checkpoint is just the step; no iterator state to pickle.
Each DP rank takes a disjoint slice of every micro-batch. Nothing but the global
batch size enters the draw: micro-batch j of dp rank r is rows block j x dp + r of
the step's global batch, so a run resumed at another dp with the same global
batch (tasks/train/reshard.py) trains on the same samples, in the same order,
grouped in the same micro-batches.

A mixture (`data.replay`) keeps that property: how many samples each source has
given before step s is a function of s alone (see `Sampler.drawn`), so each
source's position in its own permuted stream is too.

Dataset format (written by `tasks.data.manifest` / `tasks.data.prepare`, copied by `tasks.data.warm`):
`manifest.json` with `format: retrainer-dataset/1`, `dtype` (`uint16` or `uint32`,
`tasks.base.dataset_format.TOKEN_DTYPES`), `files: [{key, size, sha256}]`; shards are flat
little-endian tokens of that dtype, read by memmap; the split is the key prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from tasks.base.dataset_format import MANIFEST_KEY, TOKEN_DTYPES, manifest_hash, window_starts
from tasks.base.errors import InvalidInputError
from tasks.data.cache import sibling_dataset_dir
from tasks.data.manifest import read_manifest


def replay_dataset_dir(dataset_dir: str | Path, url: str, expected_hash: str) -> Path:
    """The warmed directory of a replay source beside the primary `dataset_dir`, holding exactly the manifest
    the run planned; InvalidInputError names the source's URL otherwise."""
    path = sibling_dataset_dir(dataset_dir, expected_hash)
    try:
        found = manifest_hash((path / MANIFEST_KEY).read_bytes())
    except OSError as exc:
        raise InvalidInputError(f"replay source {url}: not warmed at {path} ({exc.strerror}); the warm stage "
                                "puts every source of the mixture there") from None
    if found != expected_hash:
        raise InvalidInputError(f"replay source {url}: {path} holds manifest {found[:12]}, this run trains on "
                                f"{expected_hash[:12]}")
    return path


class TokenWindows:
    """All non-overlapping windows of `seq_len + 1` tokens in one split (shards are not crossed)."""

    def __init__(self, dataset_dir: str | Path, split: str, seq_len: int, vocab_size: int) -> None:
        root = Path(dataset_dir)
        manifest = read_manifest(str(root))  # validated: whole tokens of a known dtype, unique keys
        if manifest.vocab_size > vocab_size:
            raise InvalidInputError(
                f"{root / MANIFEST_KEY}: vocab_size {manifest.vocab_size} exceeds model.vocab_size {vocab_size}"
            )
        self.seq_len = seq_len
        dtype = np.dtype(TOKEN_DTYPES[manifest.dtype])
        self.shards: list[np.memmap] = []
        index: list[tuple[int, int]] = []
        for entry in manifest.split(split):
            path = root / entry.key
            if not path.is_file() or path.stat().st_size != entry.size:
                raise InvalidInputError(f"{path}: missing or wrong size (manifest says {entry.size} bytes)")
            if not entry.size:
                continue  # an empty shard holds no window (and cannot be mapped); the warm refuses an empty split
            tokens = np.memmap(path, dtype=dtype, mode="r")
            shard = len(self.shards)
            self.shards.append(tokens)
            index.extend((shard, start) for start in window_starts(len(tokens), seq_len))
        if not index:
            raise InvalidInputError(f"{root}: no {split}/ windows of {seq_len + 1} tokens in the dataset")
        self.index = index

    @classmethod
    def joined(cls, parts: list[TokenWindows]) -> TokenWindows:
        """The windows of several sources as one index space: source k's windows follow source k-1's."""
        out = cls.__new__(cls)
        out.seq_len, out.shards, out.index = parts[0].seq_len, [], []
        for part in parts:
            base = len(out.shards)
            out.shards.extend(part.shards)
            out.index.extend((base + shard, start) for shard, start in part.index)
        return out

    def __len__(self) -> int:
        return len(self.index)

    def get(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64 tokens."""
        rows = []
        for i in indices:
            shard, start = self.index[int(i)]
            rows.append(np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class Sampler:
    """Global batch of a step, and each DP rank's disjoint share of each micro-batch.

    `num_samples` are the primary source's windows; `replay` holds (windows, weight) per replay
    source, whose indices follow the primary's (as in `TokenWindows.joined`). Without replay the
    draw is the single-source one every earlier run made.
    """

    num_samples: int
    micro_batch_size: int
    micro_batches: int
    dp: int
    seed: int
    replay: tuple[tuple[int, float], ...] = ()

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise InvalidInputError(
                f"dataset has {self.num_samples} training windows, fewer than one global batch "
                f"({self.global_batch} = micro_batch_size x micro_batches x dp)"
            )
        for k, (windows, _) in enumerate(self.replay, start=1):
            if windows < self.global_batch:
                raise InvalidInputError(f"data.replay[{k - 1}] has {windows} training windows, fewer than one "
                                        f"global batch ({self.global_batch})")

    def position(self, step: int) -> dict[str, int]:
        """The data position before 0-based `step` (what a checkpoint records)."""
        return {"step": step, "epoch": step // self.steps_per_epoch, "index": step % self.steps_per_epoch}

    def drawn(self, step: int) -> list[int]:
        """Samples each source (primary first) gave before 0-based `step`.

        Replay source k: floor(w_k x global_batch x step), exactly (rational arithmetic, so every
        machine agrees); the primary: the rest. Each count only grows with the step, and every step
        sums to the global batch. (Largest remainders on the cumulative quotas would not do: a
        source's count could drop from one step to the next.) The config refuses replay weights
        that could leave the primary less than nothing in a step."""
        total = self.global_batch * step
        replay = [math.floor(Fraction(weight) * total) for _, weight in self.replay]
        return [total - sum(replay), *replay]

    def _stream(self, source: int, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of one source's stream: its windows in a permutation per epoch, an epoch
        being its windows rounded down to whole global batches (for the primary alone: the steps of an
        epoch). Seeds: (seed, epoch) for the primary, as always; (seed, k, epoch) for replay source k."""
        windows = self.num_samples if source == 0 else self.replay[source - 1][0]
        offset = self.num_samples + sum(n for n, _ in self.replay[:source - 1]) if source else 0
        length = windows // self.global_batch * self.global_batch
        positions = np.arange(start, stop)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(positions // length):
            key = [self.seed, int(epoch)] if source == 0 else [self.seed, source, int(epoch)]
            here = positions // length == epoch
            out[here] = np.random.default_rng(key).permutation(windows)[positions[here] % length]
        return out + offset

    def global_indices(self, step: int) -> np.ndarray:
        before, after = self.drawn(step), self.drawn(step + 1)
        return np.concatenate([self._stream(k, a, b) for k, (a, b) in enumerate(zip(before, after, strict=True))])

    def rank_micro_batches(self, step: int, dp_rank: int) -> list[np.ndarray]:
        """Micro-batch j of DP rank r = rows [j*mbs*dp + r*mbs, +mbs) of the global batch."""
        idx, mbs = self.global_indices(step), self.micro_batch_size
        return [
            idx[j * mbs * self.dp + dp_rank * mbs : j * mbs * self.dp + (dp_rank + 1) * mbs]
            for j in range(self.micro_batches)
        ]


def split_inputs(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token labels) of a [B, seq_len + 1] window batch."""
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()
