"""The destination: token shards streamed out per split, sha256 and size taken while writing.

A local destination gets atomic files (temp + fsync + rename, `tasks.base.fsutil`); any
other fsspec URL gets streamed objects. The manifest is written last, after every
shard is complete, and a run that fails removes the shards it wrote: a destination
holds a manifest only for a whole dataset.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Any

from tasks.base.dataset_format import MANIFEST_KEY, STARTS_DTYPE, mask_key, shard_key, starts_key, token_bytes
from tasks.base.fsutil import atomic_writer, is_local_fs, put_object
from tasks.data.manifest import Manifest, ManifestFile, claim_destination

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)


class Destination:
    """A dataset prefix: a local directory or any fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.local = is_local_fs(self.fs)

    def path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    def claim(self, overwrite: bool) -> None:
        claim_destination(self.fs, self.root, self.url, overwrite=overwrite)

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            with suppress(FileNotFoundError):
                self.fs.rm(self.path(key))

    def write_manifest(self, manifest: Manifest) -> None:
        put_object(self.fs, self.path(MANIFEST_KEY), manifest.to_bytes())


class _Object:
    """One object being streamed out: its bytes written, sha256 and size taken as they go."""

    def __init__(self, dest: Destination, key: str) -> None:
        self.key, self.size, self.sha = key, 0, hashlib.sha256()
        self.stack = ExitStack()
        path = dest.path(key)
        self.fh = self.stack.enter_context(atomic_writer(path) if dest.local else dest.fs.open(path, "wb"))

    def write(self, data: bytes) -> None:
        self.fh.write(data)
        self.sha.update(data)
        self.size += len(data)

    def commit(self) -> ManifestFile:
        self.stack.close()
        return ManifestFile(key=self.key, size=self.size, sha256=self.sha.hexdigest())

    def abort(self) -> None:
        # Exiting with an exception makes atomic_writer delete its temp file instead of renaming it.
        self.stack.__exit__(InterruptedError, InterruptedError("prepare-data aborted"), None)


class SplitWriter:
    """One split's token stream cut into shards of `tokens_per_shard` tokens (the last one shorter).

    `chat`: each token shard has its loss mask and document starts beside it (`mask_key`, `starts_key`), and a
    shard is cut between conversations (a conversation never straddles two shards: windows are packed from
    whole conversations of one shard); a conversation longer than `tokens_per_shard` fills a shard alone.
    """

    def __init__(self, dest: Destination, split: str, dtype: str, tokens_per_shard: int, chat: bool = False) -> None:
        self.dest, self.split, self.tokens_per_shard, self.chat = dest, split, tokens_per_shard, chat
        self.itemsize = token_bytes(dtype)
        self.files: list[ManifestFile] = []
        self.tokens = 0
        self.assistant_tokens = 0  # chat: tokens the mask trains on
        self._open: list[_Object] = []  # the shard being written: tokens (chat: then mask and starts)
        self._count = 0  # tokens in it
        self._shards = 0

    def write(self, tokens: np.ndarray, mask: np.ndarray | None = None, lengths: np.ndarray | None = None) -> None:
        """Plain text: a stretch of the token stream. Chat: whole conversations (`lengths` tokens each)."""
        self.tokens += tokens.size
        if self.chat:
            assert mask is not None and lengths is not None
            self.assistant_tokens += int(mask.sum())
            self._conversations(tokens, mask, lengths)
            return
        while tokens.size:
            take = min(tokens.size, self.tokens_per_shard - self._count)
            self._append(tokens[:take])
            tokens = tokens[take:]
            if self._count == self.tokens_per_shard:
                self._commit()

    def _conversations(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        import numpy as np

        offset = 0
        for length in lengths.tolist():
            if self._count and self._count + length > self.tokens_per_shard:
                self._commit()
            end = offset + length
            self._append(tokens[offset:end], mask[offset:end], np.array([self._count], dtype=STARTS_DTYPE))
            offset = end

    def close(self) -> list[ManifestFile]:
        if self._open:
            self._commit()
        return self.files

    def abort(self) -> list[str]:
        """Drop the shard being written; return the keys of this split's objects, for removal."""
        keys = [f.key for f in self.files]
        for obj in self._open:
            obj.abort()
            keys.append(obj.key)
        self._open = []
        return keys

    def _append(self, tokens: np.ndarray, mask: np.ndarray | None = None, starts: np.ndarray | None = None) -> None:
        if not self._open:
            keys = [shard_key(self.split, self._shards)]
            if self.chat:
                keys += [mask_key(keys[0]), starts_key(keys[0])]
            self._open = [_Object(self.dest, key) for key in keys]
        for obj, part in zip(self._open, (tokens, mask, starts), strict=False):
            assert part is not None
            obj.write(part.tobytes())
        self._count += tokens.size

    def _commit(self) -> None:
        self.files.extend(obj.commit() for obj in self._open)
        log.debug("prepare-data: wrote %s (%d tokens)", self._open[0].key, self._count)
        self._open, self._count, self._shards = [], 0, self._shards + 1
