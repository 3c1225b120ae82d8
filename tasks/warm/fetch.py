"""Transfer and verify objects: temp name, sha256 of the exact bytes written, fsync, rename.

Worker threads take entries from one shared iterator and issue the reads (obstore and
s3fs both release the GIL while they wait); the hot path uses string paths and no
per-file futures, since Python overhead per small object is what limits a cold warm.
An object up to `part_size` is read whole, verified in memory and written to a temp
name; small ones are then made durable in batches (one `syncfs`, then their renames),
larger ones one by one. A bigger object is read as ranged parts in parallel (a sliding
window on a second pool) and hashed in order as they are written; a server that answers
a ranged GET with the whole object gets one streamed GET instead. Objects above
BATCH_MAX_OBJECT bypass the page cache (O_DIRECT, direct.py). Each file is retried with
exponential backoff (retry.py) and then fails naming its key.
The pass that hashes an object also scans its tokens (tokens.py); an object the model cannot read
is refused before it is renamed into place (or, when small, before anything of it is written).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tasks.errors import InvalidInputError, RetrainerError
from tasks.fastcopy import SLICE
from tasks.fsutil import leads_outside
from tasks.object_source import ObjectSource, RangeUnsupportedError
from tasks.warm.direct import BufferPool, ObjectFile, write_all
from tasks.warm.retry import with_retries
from tasks.warm.tokens import ShardCheck, Tokens, TokenScan

if TYPE_CHECKING:
    from tasks.data import ManifestFile

Done = Callable[["ManifestFile", int, Tokens], None]  # (entry, mtime_ns, its tokens): once per committed file

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


def _hash_and_scan(h: Any, scan: TokenScan, data: Any) -> None:
    """Feed `data` to the hash `h` and to `scan` a slice at a time: each slice is scanned right after it is
    hashed, while it is still in the core's cache (a second pass over a 16 MiB part from memory cost a
    fifth more CPU than the hash alone; from cache, a few per cent)."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, SLICE):
        piece = view[start:start + SLICE]
        h.update(piece)
        scan.update(piece)


def _write_tmp(data: Any, tmp: str) -> int:
    """Write a whole small object to a new temp file (not yet durable); returns its mtime_ns."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data, 0)
        return os.fstat(fd).st_mtime_ns  # a rename keeps it: no second lookup of the path
    except BaseException:
        _unlink(tmp)
        raise
    finally:
        os.close(fd)


def _finish(fd: int, tmp: str, final: str) -> int:
    """fsync, close and rename into place; returns the file's mtime_ns for the record."""
    try:
        os.fsync(fd)
        mtime = os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return mtime


def _syncfs(path: str) -> bool:
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

    def __init__(self, partial_dir: str, on_done: Done) -> None:
        self.partial_dir = partial_dir
        self.on_done = on_done
        self._lock = threading.Lock()
        self._items: list[tuple[ManifestFile, str, str, int, Tokens]] = []

    def add(self, entry: ManifestFile, tmp: str, final: str, mtime_ns: int, tokens: Tokens) -> None:
        with self._lock:
            self._items.append((entry, tmp, final, mtime_ns, tokens))
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
        for _entry, tmp, _final, _mtime, _tokens in batch:
            _unlink(tmp)

    def _commit(self, batch: list[tuple[ManifestFile, str, str, int, Tokens]]) -> None:
        try:
            if not _syncfs(self.partial_dir):
                for _entry, tmp, _final, _mtime, _tokens in batch:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except BaseException:
            for _entry, tmp, _final, _mtime, _tokens in batch:
                _unlink(tmp)
            raise
        for entry, tmp, final, mtime, tokens in batch:
            os.replace(tmp, final)
            self.on_done(entry, mtime, tokens)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Fetcher:
    """Fetch a list of manifest entries from `source` into the dataset directory, each checked by `check`."""

    def __init__(self, source: ObjectSource, dataset_dir: os.PathLike[str] | str,
                 partial_dir: os.PathLike[str] | str, check: ShardCheck, *, max_workers: int,
                 on_done: Done, on_retry: Callable[[], None], part_size: int = PART_SIZE) -> None:
        self.source = source
        self.dataset_dir = os.fspath(dataset_dir)
        self.partial_dir = os.fspath(partial_dir)
        self.check = check
        self.max_workers = max_workers
        self.on_done = on_done
        self.on_retry = on_retry
        self.part_size = part_size
        self.ranged = True  # until the server answers a ranged GET with the whole object
        self.direct = os.environ.get("RETRAINER_WARM_DIRECT", "1") != "0"  # until the filesystem refuses O_DIRECT
        # Reads of large objects (head, parts, streams) in flight; whole-object reads are bounded by the workers.
        self._inflight = threading.BoundedSemaphore(max_workers)
        self._buffers = BufferPool()
        self._batcher = _CommitBatcher(self.partial_dir, on_done)
        self._parts: ThreadPoolExecutor | None = None
        self._failed = threading.Event()
        self._names = itertools.count()  # temp names: the partial dir is this warm's alone (warm lock)

    def tmp(self) -> str:
        return f"{self.partial_dir}/{next(self._names)}.part"

    def _retried(self, attempt: int, exc: BaseException) -> None:
        self.on_retry()
        log.warning("warm: retrying (attempt %d failed): %s", attempt, exc)

    def run(self, entries: Iterable[ManifestFile]) -> None:
        # Large objects first: their parts keep the pipe full while small ones fill the gaps.
        order = sorted(entries, key=lambda e: -e.size)
        if not order:
            return
        os.makedirs(self.partial_dir, exist_ok=True)
        for folder in {os.path.dirname(e.key) for e in order}:
            parent = f"{self.dataset_dir}/{folder}"
            if (target := leads_outside(self.dataset_dir, folder)) is not None:  # a link planted in the cache
                raise InvalidInputError(f"{parent}: leads to {target}, outside the cache's dataset directory "
                                        f"{self.dataset_dir}; refused")
            os.makedirs(parent, exist_ok=True)
        large = any(e.size > self.part_size for e in order)
        pending = iter(order)
        take = threading.Lock()
        errors: list[BaseException] = []

        def work() -> None:
            while not self._failed.is_set():
                with take:
                    entry = next(pending, None)
                if entry is None:
                    return
                try:
                    self._one(entry)
                except BaseException as exc:
                    errors.append(exc)
                    self._failed.set()  # the others finish the file in hand, then stop

        try:
            with ThreadPoolExecutor(max_workers=self.max_workers if large else 1,
                                    thread_name_prefix="warm-part") as parts:
                self._parts = parts
                workers = [threading.Thread(target=work, name=f"warm-{i}", daemon=True)
                           for i in range(min(self.max_workers, len(order)))]
                for t in workers:
                    t.start()
                try:
                    for t in workers:
                        t.join()
                finally:
                    self._failed.set()  # on KeyboardInterrupt too: no worker takes another file
                    for t in workers:
                        t.join()
            if errors:
                raise errors[0]
            self._batcher.flush()
        finally:  # every thread has stopped: nothing writes under partial/ any more
            self._parts = None
            self._batcher.discard()
            self._buffers.close()

    def _one(self, entry: ManifestFile) -> None:
        final = f"{self.dataset_dir}/{entry.key}"
        large = entry.size > self.part_size
        try:
            done = with_retries(lambda: self._large(entry, final) if large else self._small(entry, final),
                                self._retried)
        except InvalidInputError:
            raise  # the object is what the manifest says, and the model cannot read it: no retry changes that
        except Exception as exc:
            raise WarmFetchError(f"warm failed for key {entry.key!r}: {exc}") from exc
        if done is not None:
            self.on_done(entry, *done)

    def _small(self, entry: ManifestFile, final: str) -> tuple[int, Tokens] | None:
        """Read whole, verify and check in memory; the smallest are committed by the batcher (None: not yet)."""
        data = self.source.read(entry.key)  # the number of workers bounds these reads
        h, scan = hashlib.sha256(), self.check.scan()
        _hash_and_scan(h, scan, data)
        _check(entry, len(data), h.hexdigest())
        tokens = self.check.accept(entry.key, scan.result())
        if entry.size > BATCH_MAX_OBJECT:
            return self._write_object(entry, final, [data], None), tokens
        tmp = self.tmp()
        self._batcher.add(entry, tmp, final, _write_tmp(data, tmp), tokens)
        return None

    def _large(self, entry: ManifestFile, final: str) -> tuple[int, Tokens]:
        # A longer object is a changed object: ranged reads alone would not notice.
        with self._inflight:
            remote_size = self.source.size(entry.key)
        if remote_size != entry.size:
            raise ChecksumMismatchError(f"{entry.key}: object is {remote_size} bytes, manifest says {entry.size}")
        scan = self.check.scan()
        return self._write_object(entry, final, self._chunks(entry), scan), scan.result()

    def _write_object(self, entry: ManifestFile, final: str, chunks: Iterable[Any], scan: TokenScan | None) -> int:
        """Write chunks durably under `final`, hashing and scanning them in order unless `scan` is None (already
        verified and checked); nothing is renamed into place before the digest and the tokens pass."""
        h = hashlib.sha256() if scan is not None else None
        out = ObjectFile(self.tmp(), self._buffers, direct=self.direct)
        if self.direct and not out.direct:
            self.direct = False
            log.info("warm: %s refuses O_DIRECT; writing through the page cache", self.partial_dir)
        try:
            for data in chunks:
                if h is not None and scan is not None:
                    _hash_and_scan(h, scan, data)
                out.write(data)
            if h is not None and scan is not None:
                _check(entry, out.size, h.hexdigest())
                self.check.accept(entry.key, scan.result())
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
