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

from tasks.base.dataset_format import MANIFEST_KEY, shard_key, token_bytes
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


class SplitWriter:
    """One split's token stream cut into shards of `tokens_per_shard` tokens (the last one shorter)."""

    def __init__(self, dest: Destination, split: str, dtype: str, tokens_per_shard: int) -> None:
        self.dest, self.split, self.tokens_per_shard = dest, split, tokens_per_shard
        self.itemsize = token_bytes(dtype)
        self.files: list[ManifestFile] = []
        self.tokens = 0
        self._stack: ExitStack | None = None
        self._fh: Any = None
        self._key = ""
        self._count = 0
        self._sha = hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        self.tokens += tokens.size
        while tokens.size:
            if self._fh is None:
                self._open()
            take = min(tokens.size, self.tokens_per_shard - self._count)
            data = tokens[:take].tobytes()
            self._fh.write(data)
            self._sha.update(data)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.tokens_per_shard:
                self._commit()

    def close(self) -> list[ManifestFile]:
        if self._fh is not None:
            self._commit()
        return self.files

    def abort(self) -> list[str]:
        """Drop the shard being written; return the keys of this split's shards, for removal."""
        keys = [f.key for f in self.files]
        if self._stack is not None:
            # Exiting with an exception makes atomic_writer delete its temp file instead of renaming it.
            self._stack.__exit__(InterruptedError, InterruptedError("prepare-data aborted"), None)
            keys.append(self._key)
            self._stack = self._fh = None
        return keys

    def _open(self) -> None:
        self._key = shard_key(self.split, len(self.files))
        self._stack = ExitStack()
        path = self.dest.path(self._key)
        self._fh = self._stack.enter_context(atomic_writer(path) if self.dest.local else self.dest.fs.open(path, "wb"))
        self._count, self._sha = 0, hashlib.sha256()

    def _commit(self) -> None:
        assert self._stack is not None
        self._stack.close()
        self.files.append(ManifestFile(key=self._key, size=self._count * self.itemsize, sha256=self._sha.hexdigest()))
        log.debug("prepare-data: wrote %s (%d tokens)", self._key, self._count)
        self._stack = self._fh = None
