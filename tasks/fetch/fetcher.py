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
The pass that hashes an object also feeds the caller's `ContentCheck`, if any (the warm's token scan,
tasks/data/tokens.py); an object it refuses is refused before it is renamed into place (or, when
small, before anything of it is written).
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
from dataclasses import dataclass
from typing import Any, Protocol

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.fastcopy import SLICE
from tasks.base.fsutil import leads_outside
from tasks.base.object_source import ObjectSource, RangeUnsupportedError
from tasks.fetch.direct import BufferPool, ObjectFile, write_all
from tasks.fetch.retry import with_retries

PART_SIZE = 16 << 20
PART_WINDOW = 6
BATCH_MAX_OBJECT = 1 << 20  # objects up to this size are committed in batches
BATCH_FILES = 64


class Entry(Protocol):
    """One object to fetch: its key (relative to the source, and its path under the destination) and what its
    bytes must be (a dataset's `ManifestFile`, a tree's file as a `FileEntry`)."""

    @property
    def key(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def sha256(self) -> str: ...


@dataclass(frozen=True)
class FileEntry:
    """An `Entry` for a caller whose records name their fields otherwise (a tree file's `path` is its key)."""

    key: str
    size: int
    sha256: str


class ContentScan(Protocol):
    """What a `ContentCheck` finds in one object, fed its bytes in order."""

    def update(self, data: Any) -> None: ...

    def result(self) -> Any: ...


class ContentCheck(Protocol):
    """A check of each object's content beyond its digest, done in the pass that hashes it: `accept` raises
    InvalidInputError (not retried) for an object that must not be committed, else returns what the caller
    keeps of it (given to `on_done`)."""

    def scan(self) -> ContentScan: ...

    def accept(self, key: str, found: Any) -> Any: ...


Done = Callable[[Any, int, Any], None]  # (entry, mtime_ns, what the check kept or None): once per committed file


class ChecksumMismatchError(RetrainerError):
    """The bytes fetched for a key do not match its entry."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key = key
        self.detail = detail


class FetchError(RetrainerError):
    """A key could not be fetched and verified after bounded retries (the last failure is its cause)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def _check(entry: Entry, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ChecksumMismatchError(
            entry.key, f"fetched {size} bytes with sha256 {digest[:16]}..., manifest says {entry.size} bytes "
            f"with sha256 {entry.sha256[:16]}... (object changed behind the manifest?)")


def _hash_and_scan(h: Any, scan: ContentScan | None, data: Any) -> None:
    """Feed `data` to the hash `h` and to `scan` (if any) a slice at a time: each slice is scanned right after it
    is hashed, while it is still in the core's cache (a second pass over a 16 MiB part from memory cost a
    fifth more CPU than the hash alone; from cache, a few per cent)."""
    if scan is None:
        h.update(data)
        return
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
        self._items: list[tuple[Entry, str, str, int, Any]] = []

    def add(self, entry: Entry, tmp: str, final: str, mtime_ns: int, found: Any) -> None:
        with self._lock:
            self._items.append((entry, tmp, final, mtime_ns, found))
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
        for _entry, tmp, _final, _mtime, _found in batch:
            _unlink(tmp)

    def _commit(self, batch: list[tuple[Entry, str, str, int, Any]]) -> None:
        try:
            if not _syncfs(self.partial_dir):
                for _entry, tmp, _final, _mtime, _found in batch:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except BaseException:
            for _entry, tmp, _final, _mtime, _found in batch:
                _unlink(tmp)
            raise
        for entry, tmp, final, mtime, found in batch:
            os.replace(tmp, final)
            self.on_done(entry, mtime, found)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _nothing(*_: Any) -> None:
    return None


class Fetcher:
    """Fetch entries from `source` into `dest_dir`, each verified against its entry (and checked by `check`).

    `partial_dir` (on the same filesystem, this fetch's alone) holds the temp files; `label` starts the log
    lines and errors ("warm"), `dest_what` names `dest_dir` in them; `direct`: large objects are written with
    O_DIRECT (until the filesystem refuses it)."""

    def __init__(self, source: ObjectSource, dest_dir: os.PathLike[str] | str, partial_dir: os.PathLike[str] | str,
                 check: ContentCheck | None, *, max_workers: int, label: str, dest_what: str, log: logging.Logger,
                 on_done: Done = _nothing, on_retry: Callable[[], None] = _nothing, part_size: int = PART_SIZE,
                 direct: bool = True) -> None:
        self.source = source
        self.dest_dir = os.fspath(dest_dir)
        self.partial_dir = os.fspath(partial_dir)
        self.check = check
        self.max_workers = max_workers
        self.label = label
        self.dest_what = dest_what
        self.log = log
        self.on_done = on_done
        self.on_retry = on_retry
        self.part_size = part_size
        self.ranged = True  # until the server answers a ranged GET with the whole object
        self.direct = direct  # until the filesystem refuses O_DIRECT
        # Reads of large objects (head, parts, streams) in flight; whole-object reads are bounded by the workers.
        self._inflight = threading.BoundedSemaphore(max_workers)
        self._buffers = BufferPool()
        self._batcher = _CommitBatcher(self.partial_dir, on_done)
        self._parts: ThreadPoolExecutor | None = None
        self._failed = threading.Event()
        self._names = itertools.count()  # temp names: the partial dir is this fetch's alone

    def tmp(self) -> str:
        return f"{self.partial_dir}/{next(self._names)}.part"

    def _retried(self, attempt: int, exc: BaseException) -> None:
        self.on_retry()
        self.log.warning("%s: retrying (attempt %d failed): %s", self.label, attempt, exc)

    def run(self, entries: Iterable[Entry]) -> None:
        # Large objects first: their parts keep the pipe full while small ones fill the gaps.
        order = sorted(entries, key=lambda e: -e.size)
        if not order:
            return
        os.makedirs(self.partial_dir, exist_ok=True)
        for folder in {os.path.dirname(e.key) for e in order}:
            parent = f"{self.dest_dir}/{folder}"
            if (target := leads_outside(self.dest_dir, folder)) is not None:  # a link planted in the destination
                raise InvalidInputError(f"{parent}: leads to {target}, outside {self.dest_what} "
                                        f"{self.dest_dir}; refused")
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
                                    thread_name_prefix=f"{self.label}-part") as parts:
                self._parts = parts
                workers = [threading.Thread(target=work, name=f"{self.label}-{i}", daemon=True)
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

    def _one(self, entry: Entry) -> None:
        final = f"{self.dest_dir}/{entry.key}"
        large = entry.size > self.part_size
        try:
            done = with_retries(lambda: self._large(entry, final) if large else self._small(entry, final),
                                self._retried)
        except InvalidInputError:
            raise  # the object is what the entry says, and the check refuses it: no retry changes that
        except Exception as exc:
            raise FetchError(f"{self.label} failed for key {entry.key!r}: {exc}", entry.key) from exc
        if done is not None:
            self.on_done(entry, *done)

    def _accept(self, entry: Entry, scan: ContentScan | None) -> Any:
        """What the check keeps of a verified object (None without a check); raises if it refuses it."""
        return None if self.check is None or scan is None else self.check.accept(entry.key, scan.result())

    def _small(self, entry: Entry, final: str) -> tuple[int, Any] | None:
        """Read whole, verify and check in memory; the smallest are committed by the batcher (None: not yet)."""
        data = self.source.read(entry.key)  # the number of workers bounds these reads
        h, scan = hashlib.sha256(), self.check.scan() if self.check is not None else None
        _hash_and_scan(h, scan, data)
        _check(entry, len(data), h.hexdigest())
        found = self._accept(entry, scan)
        if entry.size > BATCH_MAX_OBJECT:
            return self._write_object(entry, final, [data], verify=False)[0], found
        tmp = self.tmp()
        self._batcher.add(entry, tmp, final, _write_tmp(data, tmp), found)
        return None

    def _large(self, entry: Entry, final: str) -> tuple[int, Any]:
        # A longer object is a changed object: ranged reads alone would not notice.
        with self._inflight:
            remote_size = self.source.size(entry.key)
        if remote_size != entry.size:
            raise ChecksumMismatchError(entry.key, f"object is {remote_size} bytes, manifest says {entry.size}")
        return self._write_object(entry, final, self._chunks(entry), verify=True)

    def _write_object(self, entry: Entry, final: str, chunks: Iterable[Any], *, verify: bool) -> tuple[int, Any]:
        """Write chunks durably under `final`; with `verify`, hash them (and scan them, with a check) in order:
        nothing is renamed into place before the digest and the check pass. Without, they were verified already.
        Returns the file's mtime_ns and what the check kept."""
        h = hashlib.sha256() if verify else None
        scan = self.check.scan() if verify and self.check is not None else None
        found = None
        out = ObjectFile(self.tmp(), self._buffers, direct=self.direct)
        if self.direct and not out.direct:
            self.direct = False
            self.log.info("%s: %s refuses O_DIRECT; writing through the page cache", self.label, self.partial_dir)
        try:
            for data in chunks:
                if h is not None:
                    _hash_and_scan(h, scan, data)
                out.write(data)
            if h is not None:
                _check(entry, out.size, h.hexdigest())
                found = self._accept(entry, scan)
            fd = out.close()
        except BaseException:
            out.abort()
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a stream gives its connection (and its in-flight slot) back now
            raise
        return _finish(fd, out.tmp, final), found

    def _chunks(self, entry: Entry) -> Iterator[Any]:
        """The object's bytes in order: parallel ranged parts, or one stream if the server ignores ranges."""
        parts = self._parts
        if self.ranged and parts is not None:
            try:
                yield from self._ranged(entry, parts)
                return
            except RangeUnsupportedError as exc:  # raised by the first part, before anything was yielded
                if self.ranged:
                    self.ranged = False
                    self.log.warning("%s: %s answers ranged GETs with whole objects (%s); streaming large "
                                     "objects in one request each", self.label, self.source.name, exc)
        with self._inflight:
            yield from self.source.stream(entry.key)

    def _ranged(self, entry: Entry, parts: ThreadPoolExecutor) -> Iterator[Any]:
        ranges = iter([(s, min(s + self.part_size, entry.size)) for s in range(0, entry.size, self.part_size)])
        window: collections.deque[Future[Any]] = collections.deque()

        def part(start: int, end: int) -> Any:
            with self._inflight:
                data = self.source.read_range(entry.key, start, end)
            if len(data) != end - start:
                raise ChecksumMismatchError(entry.key, f"range {start}-{end} returned {len(data)} bytes")
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
