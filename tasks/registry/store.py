"""Content-addressed artifact store on fsspec (local folder or s3://): single files and directory trees.

Layout under the root:
- `sha256/<2 hex>/<digest>`: a single-file artifact; its bytes hash to the digest.
- `trees/<2 hex>/<digest>/`: a tree (a Hugging Face model directory): its files and `manifest.json`,
  whose bytes hash to the digest (`tasks.registry.tree`). The manifest is the commit marker: a
  reader that finds it finds every file; without it the tree is not there.
- `tmp/<32 hex>`: uploads and staging areas in progress.
- `eval-cache/`: evaluation numbers of versions (tasks/evaluate/cache.py).
Digests are the only user-influenced part of a store path, besides a tree's own file paths,
which the manifest rules keep inside the tree. Uploads of single files go to a temporary key
and are then moved into place. Every download is hashed while streaming and refused on
mismatch, leaving nothing at the destination.

A tree is written in two steps so that many writers (training ranks, on other machines) can
fill one: `stage()` gives a fresh staging URL, each writer puts its files there (`stage_file`,
or its own fsspec code) and reports (path, size, sha256), and `commit_tree(staging, manifest)`
checks that every listed file is there with its size, then moves the staging area to its
content address: one rename on a local disk, server-side copies on S3, the manifest last.
The commit does not re-read the bytes (hundreds of GB): the writers hashed while writing,
and every download verifies them.

`contents()` lists the store as housekeeping deletes it (tasks/stages/housekeeping.py), one object at a time: a single
file, a tree (its manifest first: a tree without it is not there, never a tree missing some files), or
a staging area.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.fastcopy import HashingWriter, copy_files, copy_stream, feed_file
from tasks.base.fsutil import (
    CHUNK,
    atomic_write_bytes,
    atomic_writer,
    fresh_dir,
    fsync_dir,
    fsync_tree,
    leads_outside,
    modified_at,
    sha256_bytes,
    sha256_file,
)
from tasks.base.model_files import LEGACY_FILE
from tasks.base.object_source import open_source
from tasks.registry.errors import CorruptArtifactError, NotFoundError
from tasks.registry.names import check_digest
from tasks.registry.records import ArtifactKind, ArtifactRef, VersionRecord
from tasks.registry.tree import MANIFEST_NAME, TreeFile, TreeManifest, check_path

log = logging.getLogger(__name__)

FILES_DIR = "sha256"
TREES_DIR = "trees"
TMP_DIR = "tmp"
_STAGING_NAME = re.compile(r"^[0-9a-f]{32}$")
_MAX_PROBLEMS = 5
S3_SCHEMES = ("s3", "s3a")
# Reads in flight while pulling a remote tree (files at once, and ranged parts of the large ones): one object
# store stream runs at a fraction of the link.
PULL_WORKERS = 8


def _copy_hashing(fin: Any, fout: BinaryIO | None) -> tuple[str, int]:
    """Stream `fin` into `fout` (None: read only) chunk by chunk; return (sha256 hex, bytes)."""
    h = hashlib.sha256()
    n = 0
    while chunk := fin.read(CHUNK):
        h.update(chunk)
        n += len(chunk)
        if fout is not None:
            fout.write(chunk)
    return h.hexdigest(), n


def _local_files(root: Path) -> list[tuple[str, Path]]:
    """Every file under `root` as (tree path, local path), sorted; refuse what a tree cannot hold."""
    if not root.is_dir():
        raise InvalidInputError(f"{root}: not a directory")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise InvalidInputError(f"{os.path.join(dirpath, name)}: a symlinked folder (a tree holds files)")
        for name in filenames:
            path = Path(dirpath) / name
            if (away := leads_outside(root, str(path.relative_to(root)))) is not None:
                raise InvalidInputError(f"{path}: a symlink to {away}, outside {root} (a tree holds its own files)")
            if not path.is_file():
                raise InvalidInputError(f"{path}: not a regular file")
            out.append((check_path(path.relative_to(root).as_posix(), str(path)), path))
    if not out:
        raise InvalidInputError(f"{root}: no files (a tree holds at least one)")
    return sorted(out)


def local_tree_manifest(root: str | os.PathLike[str]) -> TreeManifest:
    """The tree manifest of a local directory (what `put_tree` would commit), reading every file once."""
    return TreeManifest.of(TreeFile(path=rel, size=src.stat().st_size, sha256=sha256_file(src))
                           for rel, src in _local_files(Path(root)))


@dataclass(frozen=True)
class StoredObject:
    """One object of the store as housekeeping sees it: what it is, where, how big, when last written."""

    kind: Literal["file", "tree", "staging"]
    name: str  # the digest of a file or tree (as named in the store), a staging area's name
    path: str  # its store path (`ArtifactStore.fs`), a file or a folder
    size: int
    modified: float | None  # the newest write inside (a committed tree's: its manifest, written at commit)
    committed: bool = True  # a tree whose manifest is there


_AREAS: dict[str, Literal["file", "tree", "staging"]] = {FILES_DIR: "file", TREES_DIR: "tree", TMP_DIR: "staging"}


class ArtifactStore:
    """A content-addressed store rooted at `url` (a path, file://..., or s3://bucket/prefix)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 part_size: int | None = None) -> None:
        """`part_size`: a remote tree's files larger than this are pulled as parallel ranged parts (None: the
        fetcher's default, 16 MiB)."""
        if not url:
            raise InvalidInputError("artifact store URL must not be empty")
        self._storage_options = dict(storage_options or {})
        self._part_size = part_size
        scheme, _, rest = url.partition("://")
        if rest and scheme in S3_SCHEMES:  # s3fs (and botocore) are built when first used, not to pull
            self.local, self.root = False, rest.rstrip("/")
            self.url = f"s3://{self.root}"
            return
        self.fs, root = fsspec.core.url_to_fs(url, **self._storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/")
        self.url = self.fs.unstrip_protocol(self.root)

    @functools.cached_property
    def fs(self) -> Any:
        """The store's fsspec filesystem (an S3 store's built on first use: a pull reads through obstore, and
        importing s3fs with botocore was a third of a CLI pull's time)."""
        return fsspec.core.url_to_fs(self.url, **self._storage_options)[0]

    def _url_of(self, path: str) -> str:
        return f"s3://{path}" if "fs" not in vars(self) else self.fs.unstrip_protocol(path)

    # -- addressing ---------------------------------------------------------
    def path_for(self, digest: str) -> str:
        digest = check_digest(digest)
        return f"{self.root}/{FILES_DIR}/{digest[:2]}/{digest}"

    def url_for(self, digest: str) -> str:
        return self._url_of(self.path_for(digest))

    def tree_path(self, digest: str) -> str:
        digest = check_digest(digest)
        return f"{self.root}/{TREES_DIR}/{digest[:2]}/{digest}"

    @staticmethod
    def root_of(artifact_url: str, digest: str, kind: ArtifactKind) -> str:
        """The store URL an artifact URL (a version's `artifact_url`) lives under: a reader needs only the registry."""
        digest = check_digest(digest)
        suffix = f"/{TREES_DIR if kind == 'tree' else FILES_DIR}/{digest[:2]}/{digest}"
        if not artifact_url.endswith(suffix) or artifact_url == suffix:
            raise InvalidInputError(
                f"artifact URL {artifact_url!r} does not end in {suffix!r}, so its store is unknown: give the store")
        return artifact_url[: -len(suffix)]

    @classmethod
    def of_version(cls, rec: VersionRecord, storage_options: dict[str, Any] | None = None,
                   store_url: str | None = None) -> ArtifactStore:
        """The store a version's artifact lives in (`store_url`, else the one its artifact URL names)."""
        return cls(store_url or cls.root_of(rec.artifact_url, rec.artifact_digest, rec.artifact_kind), storage_options)

    def pull(self, rec: VersionRecord, dest: str | os.PathLike[str]) -> Path:
        """A version's artifact, every byte verified, into an empty or new `dest`: a tree as the directory itself
        (ready for `from_pretrained(dest)`), a single-file version as `dest/consolidated.pt`. Nothing is left
        on failure, and nothing is written into this store."""
        self._refuse_inside(dest)
        if rec.artifact_kind == "tree":
            return self.get_tree(rec.artifact_digest, dest)
        with fresh_dir(dest) as tmp:
            self.get(rec.artifact_digest, tmp / LEGACY_FILE)
        return Path(dest)

    def _refuse_inside(self, dest: str | os.PathLike[str]) -> None:
        """Refuse a `dest` inside this local store: the store holds content-addressed objects that housekeeping
        lists and deletes by their place, not copies. `dest`'s own last part is not followed (a symlink there
        is refused as one, by `fresh_dir`)."""
        if not self.local:
            return
        path = Path(os.path.abspath(dest))
        if (Path(os.path.realpath(path.parent)) / path.name).is_relative_to(os.path.realpath(self.root)):
            raise InvalidInputError(f"{dest}: inside the artifact store {self.url}; pull into a directory outside it")

    def exists(self, digest: str) -> bool:
        return bool(self.fs.exists(self.path_for(digest)))

    # -- housekeeping -----------------------------------------------------------
    def contents(self) -> list[StoredObject]:
        """Every single file, tree and staging area in the store, one listing per area (paginated on S3)."""
        out = []
        for area, kind in _AREAS.items():
            base = f"{self.root}/{area}"
            if not self.local:
                self.fs.invalidate_cache(base)
            depth = 1 if kind == "staging" else 2  # tmp/<name>, sha256/<2 hex>/<digest>, trees/<2 hex>/<digest>/
            groups: dict[str, list[dict[str, Any]]] = {}
            for path, info in self.fs.find(base, detail=True).items():
                rel = path[len(base) + 1:].split("/")
                groups.setdefault("/".join(rel[:depth]), []).append({**info, "rel": "/".join(rel[depth:])})
            if kind == "staging" and self.local:  # a staging area nobody wrote into yet is an empty folder
                with contextlib.suppress(FileNotFoundError):
                    for entry in self.fs.ls(base, detail=True):
                        groups.setdefault(entry["name"].rsplit("/", 1)[-1], [{**entry, "size": 0, "rel": ""}])
            for unit, files in sorted(groups.items()):
                times = [t for t in (modified_at(f) for f in files) if t is not None]
                out.append(StoredObject(
                    kind=kind, name=unit.rsplit("/", 1)[-1], path=f"{base}/{unit}", size=sum(f["size"] for f in files),
                    modified=max(times) if len(times) == len(files) else None,
                    committed=kind != "tree" or any(f["rel"] == MANIFEST_NAME for f in files)))
        return out

    def remove(self, obj: StoredObject) -> None:
        """Delete one object whole (housekeeping, of objects no version references). A committed tree loses its
        manifest first: from that moment it is not there for any reader, whatever a crash leaves of the rest."""
        if obj.kind == "tree" and obj.committed:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{obj.path}/{MANIFEST_NAME}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(obj.path, recursive=True)

    # -- single files: writing ------------------------------------------------
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
        tmp = f"{self.root}/{TMP_DIR}/{uuid.uuid4().hex}"
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
        with self.fs.open(path, "rb") as fh:
            return _copy_hashing(fh, None)[0] == digest

    # -- single files: reading ------------------------------------------------
    def get(self, digest: str, dest_path: str | os.PathLike[str]) -> Path:
        """Download to `dest_path`, verifying sha256 while streaming; raise and leave nothing on mismatch."""
        src = self.path_for(digest)
        dest = Path(dest_path)
        if not self.fs.exists(src):
            raise NotFoundError(f"artifact {digest} not found in store {self.url}")
        with self.fs.open(src, "rb") as fin, atomic_writer(dest) as fout:
            got, _ = copy_stream(fin, fout)
            if got != digest:
                # Raising inside atomic_writer removes the temporary file: dest is untouched.
                raise CorruptArtifactError(
                    f"artifact {digest} in store is corrupt (content hashes to {got}); download refused")
        return dest

    def verify(self, digest: str) -> bool:
        """True if the stored object exists and its bytes hash to `digest`."""
        path = self.path_for(digest)
        return bool(self.fs.exists(path)) and self._matches(path, digest, self.fs.info(path)["size"])

    # -- trees: writing -------------------------------------------------------
    def stage(self) -> str:
        """A fresh, empty staging area (URL) for one tree; writers anywhere fill it, `commit_tree` publishes it."""
        path = f"{self.root}/{TMP_DIR}/{uuid.uuid4().hex}"
        if self.local:
            os.makedirs(path)
        return self.fs.unstrip_protocol(path)

    def _staging_path(self, staging: str) -> str:
        """The store path of a URL `stage()` returned; anything else is refused (nothing outside tmp/ moves)."""
        url = staging.rstrip("/")
        path = f"{self.root}/{TMP_DIR}/{url.rsplit('/', 1)[-1]}"
        if not _STAGING_NAME.match(path.rsplit("/", 1)[-1]) or url not in (path, self.fs.unstrip_protocol(path)):
            raise InvalidInputError(f"staging: {staging!r} is not a staging area of store {self.url}")
        return path

    def stage_file(self, staging: str, path: str, local_file: str | os.PathLike[str]) -> TreeFile:
        """Upload one local file into a staging area as `path`, hashing while streaming (what a writer reports)."""
        return self.stage_stream(staging, path, lambda sink: feed_file(local_file, sink))

    def stage_stream(self, staging: str, path: str, produce: Callable[[HashingWriter], object]) -> TreeFile:
        """Write one file of a staging area as `path` from `produce(sink)`, hashed while written (the bytes pass
        once, never through a local temporary copy); a local file is fsynced. On failure a local partial file
        is removed (a remote one is refused by `commit_tree`, its size not matching)."""
        rel = check_path(path)
        dest = f"{self._staging_path(staging)}/{rel}"
        if self.local:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(dest, "wb", buffering=0) if self.local else self.fs.open(dest, "wb") as fout:
                sink = HashingWriter(fout)
                try:
                    produce(sink)
                except BaseException:
                    sink.abort()
                    raise
                digest, size = sink.finish()
                if self.local:
                    os.fsync(fout.fileno())
        except BaseException:
            if self.local:
                Path(dest).unlink(missing_ok=True)
            raise
        return TreeFile(path=rel, size=size, sha256=digest)

    def discard(self, staging: str) -> None:
        """Remove a staging area and whatever writers put there (an abandoned or failed tree)."""
        path = self._staging_path(staging)
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def put_tree(self, local_dir: str | os.PathLike[str]) -> ArtifactRef:
        """Upload a local directory as a tree (each file read once, hashed while uploading) and commit it."""
        files = _local_files(Path(local_dir))
        staging = self.stage()
        try:
            manifest = TreeManifest.of(self.stage_file(staging, rel, src) for rel, src in files)
            return self.commit_tree(staging, manifest)
        except BaseException:
            self.discard(staging)
            raise

    def commit_tree(self, staging: str, manifest: TreeManifest) -> ArtifactRef:
        """Publish a filled staging area as the tree `manifest` describes; idempotent on its digest.

        Every listed file must be in staging with its listed size, and nothing else (the bytes are not
        re-read: their writers hashed them, and every download verifies). Refused: nothing committed, the
        staging area kept for a look. Already committed: the staging area is discarded."""
        path = self._staging_path(staging)
        digest = manifest.digest
        final = self.tree_path(digest)
        ref = ArtifactRef(digest=digest, url=self.fs.unstrip_protocol(final), size=manifest.size, kind="tree")
        if self._committed(digest):
            log.info("tree %s already in store: commit skipped, staging discarded", digest[:12])
            self.discard(staging)
            return ref
        self._check_staged(path, staging, manifest)
        if self.local:
            self._commit_local(path, final, manifest)
        else:
            self._commit_remote(path, final, manifest)
        log.info("tree %s committed (%d files, %d bytes) to %s", digest[:12], len(manifest.files), manifest.size,
                 ref.url)
        return ref

    def _committed(self, digest: str) -> bool:
        if not self.local:
            self.fs.invalidate_cache(self.tree_path(digest))
        return bool(self.fs.exists(f"{self.tree_path(digest)}/{MANIFEST_NAME}"))

    def _check_staged(self, path: str, staging: str, manifest: TreeManifest) -> None:
        if not self.local:
            self.fs.invalidate_cache(path)  # writers elsewhere filled it after any listing we cached
        try:
            listing = self.fs.find(path, detail=True)
        except FileNotFoundError:
            listing = {}
        found = {name[len(path) + 1:]: info for name, info in listing.items()}
        found.pop(MANIFEST_NAME, None)  # left by an interrupted local commit of this staging area; rewritten
        problems = []
        for f in manifest.files:
            info = found.pop(f.path, None)
            if info is None:
                problems.append(f"{f.path} is missing")
            elif info["type"] != "file":
                problems.append(f"{f.path} is not a regular file")
            elif info["size"] != f.size:
                problems.append(f"{f.path} is {info['size']} bytes, the manifest says {f.size}")
        problems += [f"{name} is not in the manifest" for name, info in sorted(found.items())
                     if info["type"] != "directory"]
        if problems:
            more = f"; and {len(problems) - _MAX_PROBLEMS} more" if len(problems) > _MAX_PROBLEMS else ""
            raise InvalidInputError(f"tree commit refused, nothing committed (staging {staging} kept): "
                                    f"{'; '.join(problems[:_MAX_PROBLEMS])}{more}")

    def _commit_local(self, path: str, final: str, manifest: TreeManifest) -> None:
        """Manifest last into staging, everything fsynced, then one rename: the tree appears whole or not at all."""
        atomic_write_bytes(Path(path) / MANIFEST_NAME, manifest.to_bytes())
        fsync_tree(path)
        parent = Path(final).parent
        parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(path, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not self._committed(manifest.digest):
                raise RetrainerError(f"{final} exists without its {MANIFEST_NAME} (not written by retrainer?): "
                                     "remove it and commit again") from None
            log.info("tree %s was committed concurrently; staging discarded", manifest.digest[:12])
            shutil.rmtree(path, ignore_errors=True)
            return
        fsync_dir(parent)
        fsync_dir(parent.parent)

    def _commit_remote(self, path: str, final: str, manifest: TreeManifest) -> None:
        """Server-side copies (s3fs: CopyObject, multipart UploadPartCopy for big files), then the manifest."""
        self.fs.copy([f"{path}/{f.path}" for f in manifest.files], [f"{final}/{f.path}" for f in manifest.files])
        self.fs.pipe_file(f"{final}/{MANIFEST_NAME}", manifest.to_bytes())
        self.fs.rm(path, recursive=True)

    # -- trees: reading -------------------------------------------------------
    def tree_manifest(self, digest: str) -> TreeManifest:
        """The committed manifest of a tree, checked against its digest."""
        base = self.tree_path(digest)
        marker = f"{base}/{MANIFEST_NAME}"
        try:  # a remote store's through obstore, as its files are pulled
            raw = self.fs.cat_file(marker) if self.local else bytes(
                open_source(self._url_of(base), self._storage_options, 1).read(MANIFEST_NAME))
        except FileNotFoundError:
            raise NotFoundError(f"tree {digest} not found in store {self.url}") from None
        if sha256_bytes(raw) != digest:
            raise CorruptArtifactError(f"tree {digest}: {MANIFEST_NAME} is corrupt in the store "
                                       f"(hashes to {sha256_bytes(raw)}); refused")
        return TreeManifest.from_bytes(raw, f"tree {digest} {MANIFEST_NAME}")

    def get_tree(self, digest: str, dest_dir: str | os.PathLike[str], *, only: Collection[str] | None = None) -> Path:
        """Download a tree (with `only`: just those of its paths) into `dest_dir` (absent or empty), every file
        verified while streaming.

        Files land in a temporary directory beside `dest_dir`, renamed onto it only when all match:
        on any mismatch CorruptArtifactError names the file and `dest_dir` is left as it was."""
        manifest = self.tree_manifest(digest)
        base = self.tree_path(digest)
        wanted = [f for f in manifest.files if only is None or f.path in only]
        with fresh_dir(dest_dir) as tmp:
            if self.local:
                for f, (sha, size) in zip(wanted, self._copy_local(base, tmp, wanted, digest), strict=True):
                    if (sha, size) != (f.sha256, f.size):
                        raise CorruptArtifactError(
                            f"tree {digest}: {f.path} is corrupt in the store ({size} bytes hashing to {sha}, the "
                            f"manifest says {f.size} bytes, {f.sha256}); refused, nothing written")
            else:
                self._fetch_remote(base, tmp, wanted, digest)
        log.info("tree %s: %d files, %d bytes verified into %s", digest[:12], len(manifest.files), manifest.size,
                 dest_dir)
        return Path(dest_dir)

    def _fetch_remote(self, base: str, tmp: Path, files: list[TreeFile], digest: str) -> None:
        """A remote store's files into `tmp` through the fetcher the dataset warm uses (tasks/fetch): large files
        as parallel ranged parts, every file retried with backoff and verified before it is renamed into `tmp`.
        Its temporary files go to a folder of their own beside `tmp` (no name of the tree's is taken)."""
        import tempfile

        from tasks.fetch.fetcher import PART_SIZE, ChecksumMismatchError, Fetcher, FetchError, FileEntry

        source = open_source(self._url_of(base), self._storage_options, PULL_WORKERS)
        with tempfile.TemporaryDirectory(prefix=f"{tmp.name}.", suffix=".partial", dir=tmp.parent) as partial:
            fetcher = Fetcher(source, tmp, partial, None, max_workers=PULL_WORKERS, label="pull",
                              dest_what="the pull's temporary directory", log=log,
                              part_size=self._part_size or PART_SIZE)
            try:
                fetcher.run([FileEntry(f.path, f.size, f.sha256) for f in files])
            except FetchError as exc:
                cause = exc.__cause__
                if isinstance(cause, ChecksumMismatchError):
                    raise CorruptArtifactError(f"tree {digest}: {exc.key} is corrupt in the store ({cause.detail}); "
                                               "refused, nothing written") from exc
                if isinstance(cause, FileNotFoundError):
                    raise CorruptArtifactError(f"tree {digest}: {exc.key} is missing from the store; refused, "
                                               "nothing written") from None
                raise

    @staticmethod
    def _copy_local(base: str, tmp: Path, files: list[TreeFile], digest: str) -> list[tuple[str, int]]:
        """A local store's files into `tmp`, several at once, without fsspec (plain reads and writes)."""
        try:
            return copy_files([(f"{base}/{f.path}", tmp / f.path) for f in files])
        except FileNotFoundError as exc:
            raise CorruptArtifactError(f"tree {digest}: {exc.filename} is missing from the store; refused, "
                                       "nothing written") from None

    def verify_tree(self, digest: str) -> bool:
        """True if the tree is committed, its manifest hashes to `digest` and every file's bytes match it."""
        try:
            manifest = self.tree_manifest(digest)
        except (InvalidInputError, CorruptArtifactError):
            return False
        base = self.tree_path(digest)
        for f in manifest.files:
            try:
                with self.fs.open(f"{base}/{f.path}", "rb") as fin:
                    if _copy_hashing(fin, None) != (f.sha256, f.size):
                        return False
            except FileNotFoundError:
                return False
        return True
