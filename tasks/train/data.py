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

A chat dataset (the manifest's `chat`) has a loss mask and document starts beside each shard: its windows
are packed from whole conversations of one shard (best-fit decreasing, tasks/data/packing.py: a window's
conversations need not be neighbours; the rest of `seq_len + 1` tokens is padding; packed once per node by its
warm, mapped here), and `get_packed` gives what `tasks.train.packing` turns into a packed batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from tasks.base.dataset_format import (
    MANIFEST_KEY,
    MASK_DTYPE,
    TOKEN_DTYPES,
    manifest_hash,
    mask_key,
    window_starts,
)
from tasks.base.errors import InvalidInputError
from tasks.data.cache import sibling_dataset_dir
from tasks.data.manifest import read_manifest
from tasks.data.packing import document_bounds, shard_windows


def replay_dataset_dir(dataset_dir: str | Path, url: str, expected_hash: str) -> Path:
    """The warmed directory of a replay source beside the primary `dataset_dir`, holding exactly the manifest
    the run planned; InvalidInputError names the source's URL otherwise."""
    path = sibling_dataset_dir(dataset_dir, expected_hash)
    if path is None:
        raise InvalidInputError(f"replay source {url}: the primary dataset {dataset_dir} is not in a warm cache, "
                                "where the warm stage puts every source of the mixture")
    try:
        found = manifest_hash((path / MANIFEST_KEY).read_bytes())
    except OSError as exc:
        raise InvalidInputError(f"replay source {url}: not warmed at {path} ({exc.strerror}); the warm stage "
                                "puts every source of the mixture there") from None
    if found != expected_hash:
        raise InvalidInputError(f"replay source {url}: {path} holds manifest {found[:12]}, this run trains on "
                                f"{expected_hash[:12]}")
    return path


@dataclass(frozen=True)
class PackedRows:
    """Windows of whole documents, padded to `seq_len + 1`: tokens, loss mask, document ids and positions."""

    tokens: torch.Tensor  # [n, seq_len + 1] int64 (padding: 0)
    mask: torch.Tensor  # bool: an assistant token (padding: False)
    doc_ids: torch.Tensor  # int64: 0, 1, ... per document of the window; the padding one more
    position_ids: torch.Tensor  # int64: restarting at 0 at each document (and at the padding)


def _windows_of(shard: int, starts: np.ndarray) -> np.ndarray:
    """[n, 2] (shard, start) rows of one shard's windows."""
    return np.stack([np.full(len(starts), shard, dtype=np.int64), starts], axis=1)


class TokenWindows:
    """All non-overlapping windows of `seq_len + 1` tokens in one split (shards are not crossed); a chat
    dataset's windows are packed from whole conversations (`packed`)."""

    def __init__(self, dataset_dir: str | Path, split: str, seq_len: int, vocab_size: int) -> None:
        root = Path(dataset_dir)
        manifest = read_manifest(str(root))  # validated: whole tokens of a known dtype, unique keys
        if manifest.vocab_size > vocab_size:
            raise InvalidInputError(
                f"{root / MANIFEST_KEY}: vocab_size {manifest.vocab_size} exceeds model.vocab_size {vocab_size}"
            )
        self.seq_len, self.packed = seq_len, manifest.chat is not None
        dtype = np.dtype(TOKEN_DTYPES[manifest.dtype])
        self.shards: list[np.memmap] = []
        self.masks: list[np.memmap] = []  # chat: per shard
        self.starts: list[np.ndarray] = []  # chat: each shard's document starts, and its token count last
        # Per shard, (shard, start) of each of its windows (chat: (shard, its first member)) as an [n, 2] array: 3.1M
        # windows (a 12.8B-token split at seq 4096) held 313 MiB in every rank as Python tuples, 49 MiB as int64.
        index: list[np.ndarray] = []
        members: list[np.ndarray] = []  # chat: each window's documents, one after another
        done = 0  # chat: members so far, where the next window's start in `members`
        for entry in manifest.split(split):
            path = root / entry.key
            if not path.is_file() or path.stat().st_size != entry.size:
                raise InvalidInputError(f"{path}: missing or wrong size (manifest says {entry.size} bytes)")
            if not entry.size:
                continue  # an empty shard holds no window (and cannot be mapped); the warm refuses an empty split
            tokens = np.memmap(path, dtype=dtype, mode="r")
            shard = len(self.shards)
            self.shards.append(tokens)
            if not self.packed:
                at = window_starts(len(tokens), seq_len)
                index.append(_windows_of(shard, np.arange(at.start, at.stop, at.step, dtype=np.int64)))
                continue
            self.masks.append(np.memmap(root / mask_key(entry.key), dtype=MASK_DTYPE, mode="r"))
            if len(self.masks[-1]) != len(tokens):
                raise InvalidInputError(f"{path}: its loss mask does not match its tokens")
            self.starts.append(document_bounds(root, entry.key, len(tokens)))
            packed, bounds = shard_windows(root, entry.key, np.diff(self.starts[-1]), seq_len + 1)
            index.append(_windows_of(shard, done + bounds[:-1]))
            members.append(packed)
            done += len(packed)
        self.index = np.concatenate(index) if index else np.zeros((0, 2), np.int64)
        if not len(self.index):
            raise InvalidInputError(f"{root}: no {split}/ windows of {seq_len + 1} tokens in the dataset")
        self.members = np.concatenate(members) if members else np.zeros(0, np.int64)
        # chat: where each window's members end
        self.ends = np.append(self.index[1:, 1], len(self.members)) if self.packed else np.zeros(0, np.int64)

    @classmethod
    def joined(cls, parts: list[TokenWindows]) -> TokenWindows:
        """The windows of several sources as one index space: source k's windows follow source k-1's."""
        if len({part.packed for part in parts}) > 1:
            raise InvalidInputError("a replay mixture cannot mix chat (packed, assistant-only loss) and plain-text "
                                    "datasets")
        out = cls.__new__(cls)
        out.seq_len, out.packed, out.shards, out.masks, out.starts = parts[0].seq_len, parts[0].packed, [], [], []
        members, index, ends = [], [], []
        for part in parts:
            base, first = len(out.shards), sum(len(m) for m in members)
            out.shards.extend(part.shards)
            out.masks.extend(part.masks)
            out.starts.extend(part.starts)
            shift = first if part.packed else 0
            index.append(part.index + np.array([base, shift], dtype=np.int64))
            ends.append(part.ends + shift)
            members.append(part.members)
        out.index, out.ends = np.concatenate(index), np.concatenate(ends)
        out.members = np.concatenate(members)
        return out

    def __len__(self) -> int:
        return len(self.index)

    def get(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64 tokens (a plain-text dataset; a chat dataset's are `get_packed`)."""
        if self.packed:
            raise InvalidInputError("a chat dataset's windows are packed conversations scored on assistant tokens: "
                                    "this reader takes plain-text windows only")
        rows = []
        for i in indices:
            shard, start, stop = self.span(i)
            rows.append(np.asarray(self.shards[shard][start:stop], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def span(self, i: int) -> tuple[int, int, int]:
        """Shard, start and stop of plain-text window `i`'s tokens."""
        shard, start = self.index[int(i)].tolist()
        return shard, start, start + self.seq_len + 1

    def documents(self, i: int) -> tuple[int, np.ndarray]:
        """Shard and [start, stop) token ranges [n, 2] of the conversations of window `i` of a chat dataset, in
        the order the window holds them."""
        shard, first = self.index[int(i)].tolist()
        docs = self.members[first:self.ends[int(i)]]
        starts = self.starts[shard]
        return shard, np.stack([starts[docs], starts[docs + 1]], axis=1)

    def get_packed(self, indices: np.ndarray | list[int]) -> PackedRows:
        """The packed windows of a chat dataset, padded to `seq_len + 1` tokens."""
        width = self.seq_len + 1
        n = len(indices)
        tokens, mask = np.zeros((n, width), np.int64), np.zeros((n, width), bool)
        docs, positions = np.zeros((n, width), np.int64), np.zeros((n, width), np.int64)
        for row, i in enumerate(indices):
            shard, ranges = self.documents(i)
            at = 0
            for doc, (a, b) in enumerate(ranges.tolist()):
                tokens[row, at:at + b - a] = self.shards[shard][a:b]
                mask[row, at:at + b - a] = self.masks[shard][a:b]
                docs[row, at:at + b - a], positions[row, at:at + b - a] = doc, np.arange(b - a)
                at += b - a
            docs[row, at:], positions[row, at:] = len(ranges), np.arange(width - at)  # the padding
        return PackedRows(*(torch.from_numpy(t) for t in (tokens, mask, docs, positions)))

    def trained_tokens(self, indices: np.ndarray | list[int]) -> int:
        """Labels these windows train on: a masked token that is not the first of its document (nothing
        predicts a document's first token from the one before it)."""
        total = 0
        for i in indices:
            shard, ranges = self.documents(i)
            mask = self.masks[shard]
            total += sum(int(mask[a + 1:b].sum()) for a, b in ranges.tolist())
        return total

    def real_tokens(self, indices: np.ndarray | list[int]) -> int:
        """Tokens of these windows that are not padding (a chat run's packed efficiency)."""
        if not self.packed:
            return len(indices) * (self.seq_len + 1)
        return sum(int((ranges[:, 1] - ranges[:, 0]).sum()) for _, ranges in map(self.documents, indices))


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
    # Each source's permutation of the epoch it last drew from, (epoch, permutation): drawn once an epoch, not once
    # a step (24M windows, a 100B-token split at seq 4096: 1.3 s a call; a chat step calls twice). 8 bytes a window.
    _drawn: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict, init=False, repr=False, compare=False)

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
        for epoch in np.unique(positions // length).tolist():
            here = positions // length == epoch
            out[here] = self._permutation(source, windows, epoch)[positions[here] % length]
        return out + offset

    def _permutation(self, source: int, windows: int, epoch: int) -> np.ndarray:
        """The source's windows in the order of `epoch`."""
        held = self._drawn.get(source)
        if held is None or held[0] != epoch:
            key = [self.seed, epoch] if source == 0 else [self.seed, source, epoch]
            held = self._drawn[source] = (epoch, np.random.default_rng(key).permutation(windows))
        return held[1]

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
