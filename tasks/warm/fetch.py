"""Transfer and verify objects: temp name, sha256 of the exact bytes written, fsync, rename.

A pool of threads issues the reads (obstore and s3fs both release the GIL while they
wait). An object up to `part_size` is read whole, verified in memory and written to a
temp name; small ones are then made durable in batches (one `syncfs`, then their
renames), larger ones one by one. A bigger object is read as ranged parts in parallel
(a sliding window on a second pool) and hashed in order as they are written; a server
that answers a ranged GET with the whole object gets one streamed GET instead. Objects
above BATCH_MAX_OBJECT bypass the page cache (O_DIRECT, direct.py). Each file is
retried with exponential backoff (retry.py) and then fails naming its key.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import RetrainerError
from tasks.warm.direct import BufferPool, ObjectFile, write_all
from tasks.warm.retry import with_retries
from tasks.warm.source import ObjectSource, RangeUnsupportedError

if TYPE_CHECKING:
    from tasks.data import ManifestFile

log = logging.getLogger("tasks.warm")

PART_SIZE = 16 << 20
PART_WINDOW = 6
BATCH_MAX_OBJECT = 1 << 20  # objects up to this size are committed in batches
BATCH_FILES = 64


class ChecksumMismatchError(RetrainerError):
    """The bytes fetched for a key do not match the manifest."""


class WarmFetchError(RetrainerError):
    """A key could not be fetched and verified after bounded retries."""


def _check(entry: ManifestFile, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ChecksumMismatchError(
            f"{entry.key}: fetched {size} bytes with sha256 {digest[:16]}..., manifest says {entry.size} bytes "
            f"with sha256 {entry.sha256[:16]}... (object changed behind the manifest?)")


def _open_tmp(tmp: Path) -> int:
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def _write_tmp(data: Any, tmp: Path) -> None:
    fd = _open_tmp(tmp)
    try:
        write_all(fd, data, 0)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)


def _finish(fd: int, tmp: Path, final: Path) -> int:
    """fsync, close and rename into place; returns the final file's mtime_ns for the record."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return os.stat(final).st_mtime_ns


def _syncfs(path: Path) -> bool:
    """Flush every dirty page of the filesystem holding `path` (Linux syncfs(2)); False if unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, AttributeError):
        return False
    try:
        if not hasattr(libc, "syncfs"):
            return False
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}) failed: {os.strerror(err)}")
        return True
    finally:
        os.close(fd)


class _CommitBatcher:
    """Verified small objects already written to temp names, made durable and renamed in batches.

    Same guarantee as per-file fsync + rename (no rename before the data is on disk), one flush
    per batch instead of one journal commit per file.
    """

    def __init__(self, partial_dir: Path, on_done: Callable[[ManifestFile, int], None]) -> None:
        self.partial_dir = partial_dir
        self.on_done = on_done
        self._lock = threading.Lock()
        self._items: list[tuple[ManifestFile, Path, Path]] = []

    def add(self, entry: ManifestFile, tmp: Path, final: Path) -> None:
        with self._lock:
            self._items.append((entry, tmp, final))
            if len(self._items) < BATCH_FILES:
                return
            batch, self._items = self._items, []
        self._commit(batch)

    def flush(self) -> None:
        with self._lock:
            batch, self._items = self._items, []
        if batch:
            self._commit(batch)

    def discard(self) -> None:
        with self._lock:
            batch, self._items = self._items, []
        for _entry, tmp, _final in batch:
            tmp.unlink(missing_ok=True)

    def _commit(self, batch: list[tuple[ManifestFile, Path, Path]]) -> None:
        try:
            if not _syncfs(self.partial_dir):
                for _entry, tmp, _final in batch:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except BaseException:
            for _entry, tmp, _final in batch:
                tmp.unlink(missing_ok=True)
            raise
        for entry, tmp, final in batch:
            os.replace(tmp, final)
            self.on_done(entry, os.stat(final).st_mtime_ns)


class Fetcher:
    """Fetch a list of manifest entries from `source` into the dataset directory."""

    def __init__(self, source: ObjectSource, dataset_dir: Path, partial_dir: Path, *, max_workers: int,
                 on_done: Callable[[ManifestFile, int], None], on_retry: Callable[[], None],
                 part_size: int = PART_SIZE) -> None:
        self.source = source
        self.dataset_dir = dataset_dir
        self.partial_dir = partial_dir
        self.max_workers = max_workers
        self.on_done = on_done  # (entry, mtime_ns), called once per committed file
        self.on_retry = on_retry
        self.part_size = part_size
        self.ranged = True  # until the server answers a ranged GET with the whole object
        self.direct = os.environ.get("RETRAINER_WARM_DIRECT", "1") != "0"  # until the filesystem refuses O_DIRECT
        self._buffers = BufferPool()
        # Reads of large objects (head, parts, streams) in flight; whole-object reads are bounded by the pool.
        self._inflight = threading.BoundedSemaphore(max_workers)
        self._batcher = _CommitBatcher(partial_dir, on_done)
        self._parts: ThreadPoolExecutor | None = None
        self._failed = threading.Event()

    def tmp(self) -> Path:
        return self.partial_dir / f"{os.urandom(16).hex()}.part"

    def _retried(self, attempt: int, exc: BaseException) -> None:
        self.on_retry()
        log.warning("warm: retrying (attempt %d failed): %s", attempt, exc)

    def run(self, entries: Iterable[ManifestFile]) -> None:
        # Large objects first: their parts keep the pipe full while small ones fill the gaps.
        order = sorted(entries, key=lambda e: -e.size)
        if not order:
            return
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        for parent in {(self.dataset_dir / e.key).parent for e in order}:
            parent.mkdir(parents=True, exist_ok=True)
        large = any(e.size > self.part_size for e in order)
        try:
            with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="warm") as pool, \
                    ThreadPoolExecutor(max_workers=self.max_workers if large else 1,
                                       thread_name_prefix="warm-part") as parts:
                self._parts = parts
                futures = [pool.submit(self._one, e) for e in order]
                try:
                    for f in futures:
                        f.result()
                    self._batcher.flush()
                except BaseException:
                    self._failed.set()  # queued files give up at once; running ones finish their read
                    for f in futures:
                        f.cancel()
                    raise
        finally:  # both pools have drained: no thread writes under partial/ any more
            self._parts = None
            self._batcher.discard()
            self._buffers.close()

    def _one(self, entry: ManifestFile) -> None:
        if self._failed.is_set():
            return
        final = self.dataset_dir / entry.key
        large = entry.size > self.part_size
        try:
            mtime = with_retries(lambda: self._large(entry, final) if large else self._small(entry, final),
                                 self._retried)
        except Exception as exc:
            raise WarmFetchError(f"warm failed for key {entry.key!r}: {exc}") from exc
        if mtime is not None:
            self.on_done(entry, mtime)

    def _small(self, entry: ManifestFile, final: Path) -> int | None:
        """Read whole and verify in memory; the smallest are committed by the batcher (None: not yet)."""
        data = self.source.read(entry.key)  # the pool's size bounds these reads
        _check(entry, len(data), hashlib.sha256(data).hexdigest())
        if entry.size > BATCH_MAX_OBJECT:
            return self._write_object(entry, final, [data], None)
        tmp = self.tmp()
        _write_tmp(data, tmp)
        self._batcher.add(entry, tmp, final)
        return None

    def _large(self, entry: ManifestFile, final: Path) -> int:
        # A longer object is a changed object: ranged reads alone would not notice.
        with self._inflight:
            remote_size = self.source.size(entry.key)
        if remote_size != entry.size:
            raise ChecksumMismatchError(f"{entry.key}: object is {remote_size} bytes, manifest says {entry.size}")
        return self._write_object(entry, final, self._chunks(entry), hashlib.sha256())

    def _write_object(self, entry: ManifestFile, final: Path, chunks: Iterable[Any], h: Any) -> int:
        """Write chunks (hashing them in order unless `h` is None: already verified) durably under `final`."""
        out = ObjectFile(self.tmp(), self._buffers, direct=self.direct)
        if self.direct and not out.direct:
            self.direct = False
            log.info("warm: %s refuses O_DIRECT; writing through the page cache", self.partial_dir)
        try:
            for data in chunks:
                if h is not None:
                    h.update(data)
                out.write(data)
            if h is not None:
                _check(entry, out.size, h.hexdigest())
            fd = out.close()
        except BaseException:
            out.abort()
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a stream gives its connection (and its in-flight slot) back now
            raise
        return _finish(fd, out.tmp, final)

    def _chunks(self, entry: ManifestFile) -> Iterator[Any]:
        """The object's bytes in order: parallel ranged parts, or one stream if the server ignores ranges."""
        parts = self._parts
        if self.ranged and parts is not None:
            try:
                yield from self._ranged(entry, parts)
                return
            except RangeUnsupportedError as exc:  # raised by the first part, before anything was yielded
                if self.ranged:
                    self.ranged = False
                    log.warning("warm: %s answers ranged GETs with whole objects (%s); streaming large "
                                "objects in one request each", self.source.name, exc)
        with self._inflight:
            yield from self.source.stream(entry.key)

    def _ranged(self, entry: ManifestFile, parts: ThreadPoolExecutor) -> Iterator[Any]:
        ranges = iter([(s, min(s + self.part_size, entry.size)) for s in range(0, entry.size, self.part_size)])
        window: collections.deque[Future[Any]] = collections.deque()

        def part(start: int, end: int) -> Any:
            with self._inflight:
                data = self.source.read_range(entry.key, start, end)
            if len(data) != end - start:
                raise ChecksumMismatchError(f"{entry.key}: range {start}-{end} returned {len(data)} bytes")
            return data

        try:
            for r in ranges:
                window.append(parts.submit(part, *r))
                if len(window) >= PART_WINDOW:
                    break
            while window:
                data = window.popleft().result()
                nxt = next(ranges, None)
                if nxt is not None:
                    window.append(parts.submit(part, *nxt))
                yield data
        finally:
            for f in window:
                f.cancel()
