"""The dataset format's names and key rules, without pydantic.

Kept apart from `tasks.data.manifest` (the pydantic manifest model) so that a no-op re-warm
can recognise a dataset it already holds in milliseconds, without importing pydantic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

FORMAT = "retrainer-dataset/1"
MANIFEST_KEY = "manifest.json"
SPLITS = ("train", "heldout")

# Token dtype as the manifest names it -> the numpy dtype of its shards (flat, little-endian).
# Every writer and reader takes its dtypes from here.
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}

# A chat dataset (its manifest has a `chat` section) keeps two more objects per token shard, under their own roots
# so that a split's prefix still holds token shards only: the loss mask (one byte per token: 1 = an assistant token,
# trained on) and the documents' start offsets in the shard (one conversation each, in order).
MASK_ROOT, STARTS_ROOT = "loss_mask", "doc_starts"
MASK_DTYPE, STARTS_DTYPE = "<u1", "<u8"


def token_bytes(name: str) -> int:
    """Bytes per token of a dtype: a shard's size is a whole multiple of it."""
    return int(TOKEN_DTYPES[name][2:])


def dtype_capacity(name: str) -> int:
    """How many token ids a dtype holds (ids 0 .. capacity - 1)."""
    return 1 << (8 * token_bytes(name))


MAX_VOCAB = max(dtype_capacity(name) for name in TOKEN_DTYPES)


def wider_dtype(name: str) -> str | None:
    """The next wider token dtype, or None: wider tokens written under a manifest that says `name` are what a
    warm looks for when the dtype and the bytes disagree."""
    wider = sorted((other for other in TOKEN_DTYPES if token_bytes(other) > token_bytes(name)), key=token_bytes)
    return wider[0] if wider else None


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token dtype holding every id of the vocabulary: uint16 when it fits, else uint32."""
    for name in sorted(TOKEN_DTYPES, key=dtype_capacity):
        if vocab_size <= dtype_capacity(name):
            return name
    raise ValueError(f"vocab_size {vocab_size} exceeds the widest token dtype ({MAX_VOCAB} ids)")


def shard_key(split: str, index: int) -> str:
    """The object key of one token shard of a split."""
    return f"{split}/shard-{index:05d}.bin"


def mask_key(shard: str) -> str:
    """The loss mask of the token shard whose key is `shard` (chat datasets)."""
    return f"{MASK_ROOT}/{shard}"


def starts_key(shard: str) -> str:
    """The document start offsets of the token shard whose key is `shard` (chat datasets)."""
    return f"{STARTS_ROOT}/{shard}"


def validate_key(key: str) -> str:
    """Refuse object keys that could escape a cache root or collide (`relative_key`), and the manifest's own key."""
    if relative_key(key) == MANIFEST_KEY:
        raise ValueError(f"key {key!r} is reserved for the manifest itself")
    return key


def relative_key(key: str) -> str:
    """Refuse a key (a path under a root) that could escape the root or collide: `..`, absolute, NUL, empty
    segments."""
    if not key:
        raise ValueError("key is empty")
    if "\x00" in key:
        raise ValueError(f"key {key!r} contains NUL")
    if key.startswith("/") or "\\" in key or (len(key) > 1 and key[1] == ":"):
        raise ValueError(f"key {key!r} is absolute or uses backslashes")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"key {key!r} has an empty, '.' or '..' segment")
    return key


def manifest_hash(raw: bytes) -> str:
    """The dataset's identity: sha256 of the manifest file's bytes as stored."""
    return hashlib.sha256(raw).hexdigest()


def window_starts(n_tokens: int, seq_len: int) -> range:
    """Where the windows of `seq_len + 1` tokens of one shard of `n_tokens` start (non-overlapping inputs)."""
    return range(0, n_tokens - seq_len, seq_len)


def packed_windows_bound(n_tokens: int, documents: int, seq_len: int) -> int:
    """At most how many windows of `seq_len + 1` tokens one chat shard's `documents` (`n_tokens` in all) pack
    into (tasks/data/packing.py `pack_windows`), known from the manifest before any rank packs them. The packing
    opens a window only for a document no open window has room for, so any two windows together hold more than
    one window's tokens: at most 2 x tokens / capacity + 1 windows, and never more than one a document."""
    return min(documents, 2 * n_tokens // (seq_len + 1) + 1)


# What every rank keeps to index a split (tasks/train/data.py `TokenWindows`; a training split also its `Sampler`
# permutation), int64 throughout: a window's (shard, start), its place in the epoch's permutation and, in a chat
# split, where its documents end; a chat split's document (conversation) its place among a window's members and
# its start in the shard.
INDEX_BYTES_PER_WINDOW, PERMUTATION_BYTES_PER_WINDOW, CHAT_BYTES_PER_WINDOW, CHAT_BYTES_PER_DOCUMENT = 16, 8, 8, 16


@dataclass(frozen=True)
class SplitShape:
    """The windows of one split of a dataset at a sequence length (a chat split's: `packed_windows_bound`) and,
    in a chat split, its documents: what a rank's index of it holds (`index_bytes`)."""

    windows: int
    documents: int = 0
    packed: bool = False

    def index_bytes(self, *, sampled: bool) -> int:
        """The bytes a rank holds to index this split; `sampled`: a training split, drawn by the sampler."""
        per_window = INDEX_BYTES_PER_WINDOW + (PERMUTATION_BYTES_PER_WINDOW if sampled else 0) \
            + (CHAT_BYTES_PER_WINDOW if self.packed else 0)
        return self.windows * per_window + self.documents * CHAT_BYTES_PER_DOCUMENT


@dataclass(frozen=True)
class PlannedData:
    """What the planner needs of a run's datasets, read from their manifests (tasks/data/sources.py
    `planned_data`): whether the training windows are packed conversations (their ids and document masks are
    activations too), the bytes every training rank holds to index the train splits of the data and each replay
    source, and those an evaluation rank holds for the largest split a suite reads (one suite at a time)."""

    packed: bool = False
    train_index_bytes: int = 0
    eval_index_bytes: int = 0
