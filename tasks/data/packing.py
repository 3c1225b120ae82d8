"""A chat dataset's conversations packed into windows, once per node.

Why once: the packing is a sequential loop (best-fit decreasing, ~1 us a conversation), and every rank used to pack
its whole split at start: at 100M conversations ~80 s and ~2 GB of work arrays in each of a node's ranks. The
node's warm (tasks/data/warm.py, before any rank starts) packs each chat split the run reads at its sequence length
into the cache beside the dataset (`CacheLayout.packing_dir`: per shard its windows' documents and bounds, two
.npy files), and each rank maps them, checked (`_canonical`); a rank that finds none (a dataset outside a cache,
a packing of another format or a damaged one) packs for itself and gets the same windows: `pack_windows` is a pure
function of the lengths.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_left, insort
from pathlib import Path

import numpy as np

from tasks.base.dataset_format import STARTS_DTYPE, starts_key
from tasks.base.errors import InvalidInputError
from tasks.data.cache import cache_of

log = logging.getLogger(__name__)

# The packing's format: bumped whenever `pack_windows` packs any lengths differently, so that a node never maps
# windows another version packed (ranks packing for themselves and ranks reading the file must agree).
PACKING_FORMAT = 1

# Documents taken into the packing loop at a time: its Python ints are made a chunk at a time, not for the whole
# shard at once (100M conversations as Python lists were ~7 GB in every rank, beside the result's).
_PACK_CHUNK = 1 << 16


def pack_windows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows of at most `capacity` tokens that documents of `lengths` pack into, best-fit decreasing: the
    longest document first, each into the fullest window it fits, a new window when none has room. Returned
    flat, as int64 arrays: window w holds documents `members[bounds[w]:bounds[w + 1]]` (ascending), the windows
    ordered by their first document. A pure function of the lengths, so every rank and every resume packs the
    same windows; a document longer than `capacity` (prepare-data cut or dropped those) is refused. About
    1.2 us a document (bisect over the distinct free capacities, at most `capacity` of them) and a few int64
    arrays of the documents' length beside the result while it runs."""
    if len(lengths) and int(lengths.max()) > capacity:
        raise InvalidInputError(f"a document of {int(lengths.max())} tokens does not fit a window of {capacity}")
    free: list[int] = []  # the distinct free capacities of open windows, ascending
    holders: dict[int, list[int]] = {}  # free capacity -> the windows with exactly that much left
    lengths = np.asarray(lengths)
    index_dtype = np.int32 if len(lengths) < 2**31 else np.int64  # documents and windows: half the bytes
    window_of = np.empty(len(lengths), index_dtype)  # each document's window, in the order windows opened
    opened = 0
    order = np.argsort(-lengths.astype(np.int32), kind="stable").astype(index_dtype)  # lengths <= capacity
    for at in range(0, len(order), _PACK_CHUNK):
        docs = order[at:at + _PACK_CHUNK]
        placed = []
        for size in lengths[docs].tolist():
            k = bisect_left(free, size)
            if k == len(free):
                window, left = opened, capacity - size
                opened += 1
            else:
                have = free[k]
                stack = holders[have]
                window, left = stack.pop(), have - size
                if not stack:
                    del holders[have], free[k]
            placed.append(window)
            if left:
                if left in holders:
                    holders[left].append(window)
                else:
                    holders[left] = [window]
                    insort(free, left)
        window_of[docs] = placed
    del order
    # Renumber the windows by their first (lowest) document; a stable sort keeps each window's documents ascending.
    first_doc = np.full(opened, len(lengths), index_dtype)
    np.minimum.at(first_doc, window_of, np.arange(len(lengths), dtype=index_dtype))
    renumbered = np.empty(opened, index_dtype)
    renumbered[np.argsort(first_doc, kind="stable")] = np.arange(opened, dtype=index_dtype)
    np.take(renumbered, window_of, out=window_of)
    members = np.argsort(window_of, kind="stable")
    bounds = np.zeros(opened + 1, np.int64)
    np.cumsum(np.bincount(window_of, minlength=opened), out=bounds[1:])
    return members, bounds


def document_bounds(dataset_dir: Path, shard_key: str, n_tokens: int) -> np.ndarray:
    """Where each conversation of one chat shard starts, the shard's token count last (conversation i is tokens
    [bounds[i], bounds[i + 1]); `np.diff` gives the lengths); InvalidInputError when the starts do not fit it."""
    starts = np.fromfile(dataset_dir / starts_key(shard_key), dtype=STARTS_DTYPE).astype(np.int64)
    if not len(starts) or starts[0] or starts[-1] >= n_tokens or np.any(np.diff(starts) < 0):
        raise InvalidInputError(f"{dataset_dir / shard_key}: its document starts do not match its tokens")
    return np.append(starts, n_tokens)


def _files(dataset_dir: Path, shard_key: str, capacity: int) -> tuple[Path, Path] | None:
    """Where the warm keeps one shard's packing (documents, bounds); None for a dataset outside a cache."""
    layout = cache_of(dataset_dir)
    if layout is None:
        return None
    base = layout.packing_dir(dataset_dir.name) / f"v{PACKING_FORMAT}-window{capacity}" / shard_key
    return base.with_name(f"{base.name}.members.npy"), base.with_name(f"{base.name}.bounds.npy")


def _canonical(members: np.ndarray, bounds: np.ndarray, lengths: np.ndarray, capacity: int) -> bool:
    """Whether (members, bounds) are windows of these documents as `pack_windows` lays them out: each document
    once, none over capacity, ascending within a window, windows in the order of their first document."""
    n = len(lengths)
    if members.dtype != np.int64 or bounds.dtype != np.int64 or members.shape != (n,) or bounds.ndim != 1 \
            or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or np.any(np.diff(bounds) <= 0):
        return False
    if members.min() < 0 or members.max() >= n or np.bincount(members, minlength=n).max() != 1:
        return False
    rising = np.diff(members) > 0
    rising[bounds[1:-1] - 1] = True  # a window's first document need not follow the last one's
    firsts = members[bounds[:-1]]
    return bool(rising.all() and np.all(np.diff(firsts) > 0)
                and np.add.reduceat(lengths[members], bounds[:-1]).max() <= capacity)


def cached_packing(dataset_dir: Path, shard_key: str, lengths: np.ndarray,
                   capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The warm's packing of one shard, mapped, if the cache holds a sound one."""
    files = _files(dataset_dir, shard_key, capacity)
    if files is None or not files[1].is_file():
        return None
    try:
        members, bounds = (np.load(path, mmap_mode="r", allow_pickle=False) for path in files)
    except (OSError, ValueError) as exc:
        log.warning("%s: the cached packing is unreadable (%s): packing the shard here", files[0], exc)
        return None
    if not _canonical(members, bounds, lengths, capacity):
        log.warning("%s: the cached packing does not fit the shard: packing it here", files[0])
        return None
    return members, bounds


def shard_windows(dataset_dir: Path, shard_key: str, lengths: np.ndarray,
                  capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """One chat shard's windows (`pack_windows`' arrays): the warm's packing when there is one, else packed here."""
    cached = cached_packing(dataset_dir, shard_key, lengths, capacity)
    return cached if cached is not None else pack_windows(lengths, capacity)


def write_packing(dataset_dir: Path, shard_key: str, n_tokens: int, capacity: int) -> bool:
    """Pack one shard into the cache (the node's warm, before any rank starts), unless a sound packing is there;
    whether one was written. Each file is replaced whole: a concurrent warm writes the same bytes."""
    files = _files(dataset_dir, shard_key, capacity)
    if files is None:
        return False
    lengths = np.diff(document_bounds(dataset_dir, shard_key, n_tokens))
    if cached_packing(dataset_dir, shard_key, lengths, capacity) is not None:
        return False
    files[0].parent.mkdir(parents=True, exist_ok=True)
    for path, array in zip(files, pack_windows(lengths, capacity), strict=True):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    return True
