"""A dataset's token shards checked where a warm reads every byte anyway, for its sha256.

Why at warm: a shard holding an id the model has no row for, an empty split, or a manifest whose dtype
contradicts the bytes crashes a rank (an IndexError, "cannot mmap an empty file") long after the data was
copied. Each file's bytes are scanned in the pass that hashes them (numpy's max over each chunk viewed as the
manifest's dtype: tens of GB/s where sha256 runs at 1-2), never read a second time, and its largest id is kept
in the cache's record, so a later warm, or a plan, of the same data for a smaller vocabulary refuses it
without reading anything (tasks/data/sources.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.base.dataset_format import TOKEN_DTYPES, token_bytes, wider_dtype
from tasks.base.errors import InvalidInputError


@dataclass(frozen=True)
class Tokens:
    """What the scan of one file found: its largest token id (None: empty), and the largest value of its bytes
    read as the next wider dtype (None: there is none, or the size is not a whole number of those)."""

    max_id: int | None
    wider_max: int | None


class TokenScan:
    """The `Tokens` of one file, fed its bytes in order in chunks of any size: a token cut by a chunk boundary
    is completed from the next chunk, so every view stays aligned to the file's start."""

    def __init__(self, dtype: str) -> None:
        import numpy as np  # lazy: a no-op re-warm never scans, and never pays for numpy

        wider = wider_dtype(dtype)
        self._np = np
        self._views = [np.dtype(TOKEN_DTYPES[name]) for name in (dtype, wider) if name is not None]
        self._block = self._views[-1].itemsize  # scanned in whole blocks of the widest view
        self._maxima = [-1] * len(self._views)
        self._carry = b""
        self._size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._size += view.nbytes
        if self._carry:
            take = self._block - len(self._carry)
            self._carry += bytes(view[:take])
            view = view[take:]
            if len(self._carry) < self._block:
                return
            self._scan(self._carry)
        whole = view.nbytes - view.nbytes % self._block
        if whole:
            self._scan(view[:whole])
        self._carry = bytes(view[whole:])

    def _scan(self, block: Any) -> None:
        for i, dtype in enumerate(self._views):
            self._maxima[i] = max(self._maxima[i], int(self._np.frombuffer(block, dtype).max()))

    def result(self) -> Tokens:
        """The file's tokens once every byte was fed (a last partial token of a non-shard file is ignored)."""
        own = self._views[0]
        tail = self._carry[:len(self._carry) - len(self._carry) % own.itemsize]
        max_id = max(self._maxima[0], int(self._np.frombuffer(tail, own).max()) if tail else -1)
        wider = self._maxima[1] if len(self._views) > 1 and self._size % self._block == 0 else -1
        return Tokens(max_id if max_id >= 0 else None, wider if wider >= 0 else None)


@dataclass(frozen=True)
class ShardRules:
    """What the model that reads a dataset needs of it: each split it reads holds tokens, and every id in those
    splits is below `vocab_size` (None: a warm without a model, e.g. `warm-url`, checks nothing). `field` is the
    config field that names the dataset, for errors."""

    vocab_size: int | None = None
    splits: tuple[str, ...] = ()
    field: str = ""

    def reads(self, key: str) -> bool:
        return any(key.startswith(f"{split}/") for split in self.splits)


@dataclass(frozen=True)
class ShardCheck:
    """One dataset checked against the rules of the model that reads it: its manifest before anything is
    written, each file's tokens before it is committed (or, when already cached, from the record)."""

    rules: ShardRules
    where: str  # the manifest's URL (or the cached dataset) and the config field: how errors name the dataset
    dtype: str
    vocab_size: int  # the manifest's

    def refuse_manifest(self, sizes: Mapping[str, int]) -> None:
        """Each split read lists a file with bytes; those files are whole tokens; the manifest's vocabulary
        fits the model's."""
        for split in self.rules.splits:
            files = [size for key, size in sizes.items() if key.startswith(f"{split}/")]
            purpose = "train" if split == "train" else "evaluate"
            if not files:
                raise InvalidInputError(f"{self.where}: manifest lists no {split}/ files: nothing to {purpose} on")
            if not any(files):
                raise InvalidInputError(f"{self.where}: every {split}/ file is empty ({len(files)} of 0 bytes): "
                                        f"nothing to {purpose} on")
        width = token_bytes(self.dtype)
        for key, size in sizes.items():
            if self.rules.reads(key) and size % width:
                raise InvalidInputError(f"{self.where}: {key}: {size} bytes is not a whole number of {self.dtype} "
                                        f"tokens ({width} bytes each)")
        if self.rules.vocab_size is not None and self.vocab_size > self.rules.vocab_size:
            raise InvalidInputError(f"{self.where}: manifest vocab_size {self.vocab_size} exceeds model.vocab_size "
                                    f"{self.rules.vocab_size}")

    def scan(self) -> TokenScan:
        return TokenScan(self.dtype)

    def accept(self, key: str, tokens: Tokens) -> Tokens:
        """`tokens` if the model can read the file `key`; else InvalidInputError naming the file and the id."""
        vocab = self.rules.vocab_size
        if vocab is None or not self.rules.reads(key) or tokens.max_id is None:
            return tokens
        if tokens.max_id >= vocab:
            raise InvalidInputError(f"{self.where}: {key} holds token id {tokens.max_id}, not below "
                                    f"model.vocab_size {vocab}")
        # Ids below 2^16 written as uint32 under a uint16 manifest read as each id followed by a 0: every
        # "token" is below the vocabulary, and the model would train on noise. Real uint16 text read as
        # uint32 gives values of 65536 and more almost at once.
        if tokens.wider_max is not None and tokens.max_id > 0 and tokens.wider_max < vocab:
            wider = wider_dtype(self.dtype)
            raise InvalidInputError(f"{self.where}: {key} looks like {wider} tokens, not the manifest's {self.dtype}: "
                                    f"read as {wider} its largest id is {tokens.wider_max}, below model.vocab_size "
                                    f"{vocab} (every second {self.dtype} token is 0); the manifest's dtype "
                                    "contradicts the bytes")
        return tokens


def max_by_split(files: Mapping[str, Tokens]) -> dict[str, int]:
    """The largest token id of each split (a key's first folder), over its files with tokens: the record's
    summary beside each file's own."""
    out: dict[str, int] = {}
    for key, tokens in files.items():
        split, sep, _ = key.partition("/")
        if sep and tokens.max_id is not None:
            out[split] = max(out.get(split, -1), tokens.max_id)
    return out
