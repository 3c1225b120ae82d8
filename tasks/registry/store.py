"""Content-addressed artifact store on fsspec (local folder or s3://).

Every object lives at `<root>/sha256/<2 hex>/<hash>`: names given by users never
form paths, so nothing can escape the store. Uploads go to a temporary key and are
then moved into place, so a reader never sees a partial object. Every download
is hashed while streaming and refused on mismatch, leaving nothing at the destination.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tasks.errors import InvalidInputError
from tasks.fsutil import CHUNK, atomic_writer, fsync_dir, sha256_file
from tasks.registry.errors import CorruptArtifactError, NotFoundError
from tasks.registry.names import check_digest
from tasks.registry.records import ArtifactRef

log = logging.getLogger(__name__)


class ArtifactStore:
    """A content-addressed store rooted at `url` (a path, file://..., or s3://bucket/prefix)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not url:
            raise InvalidInputError("artifact store URL must not be empty")
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/")

    # -- addressing ---------------------------------------------------------
    def path_for(self, digest: str) -> str:
        digest = check_digest(digest)
        return f"{self.root}/sha256/{digest[:2]}/{digest}"

    def url_for(self, digest: str) -> str:
        return self.fs.unstrip_protocol(self.path_for(digest))

    def exists(self, digest: str) -> bool:
        return bool(self.fs.exists(self.path_for(digest)))

    # -- writing ------------------------------------------------------------
    def put(self, local_path: str | os.PathLike[str], *, verify_existing: bool = True) -> ArtifactRef:
        """Upload a file under its sha256; skip the upload if the store already holds those bytes."""
        src = Path(local_path)
        if not src.is_file():
            raise InvalidInputError(f"{src}: artifact file does not exist")
        digest = sha256_file(src)
        size = src.stat().st_size
        ref = ArtifactRef(digest=digest, url=self.url_for(digest), size=size)
        dest = self.path_for(digest)
        if self.fs.exists(dest):
            if not verify_existing or self._matches(dest, digest, size):
                log.info("artifact %s already in store, upload skipped", digest[:12])
                return ref
            log.warning("artifact %s in store is corrupt; replacing it", digest[:12])
        if self.local:
            self._put_local(src, dest)
        else:
            self._put_remote(src, dest, size)
        log.info("artifact %s uploaded (%d bytes) to %s", digest[:12], size, ref.url)
        return ref

    def _put_local(self, src: Path, dest: str) -> None:
        with open(src, "rb") as fin, atomic_writer(dest) as fout:
            while chunk := fin.read(CHUNK):
                fout.write(chunk)
        fsync_dir(Path(dest).parent.parent)

    def _put_remote(self, src: Path, dest: str, size: int) -> None:
        tmp = f"{self.root}/tmp/{uuid.uuid4().hex}"
        try:
            self.fs.put_file(str(src), tmp)
            self.fs.mv(tmp, dest)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)
        self.fs.invalidate_cache(dest)
        got = self.fs.info(dest)["size"]
        if got != size:
            raise CorruptArtifactError(f"{self.url_for(Path(dest).name)}: uploaded {size} bytes, store has {got}")

    def _matches(self, path: str, digest: str, size: int) -> bool:
        if self.fs.info(path)["size"] != size:
            return False
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
        return h.hexdigest() == digest

    # -- reading ------------------------------------------------------------
    def get(self, digest: str, dest_path: str | os.PathLike[str]) -> Path:
        """Download to `dest_path`, verifying sha256 while streaming; raise and leave nothing on mismatch."""
        src = self.path_for(digest)
        dest = Path(dest_path)
        if not self.fs.exists(src):
            raise NotFoundError(f"artifact {digest} not found in store {self.fs.unstrip_protocol(self.root)}")
        h = hashlib.sha256()
        with self.fs.open(src, "rb") as fin, atomic_writer(dest) as fout:
            while chunk := fin.read(CHUNK):
                h.update(chunk)
                fout.write(chunk)
            if h.hexdigest() != digest:
                # Raising inside atomic_writer removes the temporary file: dest is untouched.
                raise CorruptArtifactError(
                    f"artifact {digest} in store is corrupt (content hashes to {h.hexdigest()}); download refused"
                )
        return dest

    def verify(self, digest: str) -> bool:
        """True if the stored object exists and its bytes hash to `digest`."""
        path = self.path_for(digest)
        return bool(self.fs.exists(path)) and self._matches(path, digest, self.fs.info(path)["size"])
