"""Transfer and verify objects: temp name, sha256 of the exact bytes written, fsync, rename.

Async filesystems (s3fs, gcsfs, ...) run many requests on the filesystem's own event
loop, with a semaphore bounding requests in flight; objects larger than `part_size`
are fetched as ranged parts in parallel (a sliding window) and hashed in order as
they are written. Other filesystems use a thread pool of streaming reads. Disk
work (write, fsync, rename) runs in a thread pool so the event loop keeps fetching.
Each file is retried with exponential backoff (tenacity) and then fails naming its key.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from tasks.data import ManifestFile
from tasks.errors import RetrainerError

log = logging.getLogger("tasks.warm")

PART_SIZE = 16 << 20
PART_WINDOW = 6
BATCH_MAX_OBJECT = 1 << 20  # objects up to this size are committed in batches
BATCH_FILES = 64
ATTEMPTS = 4


class ChecksumMismatchError(RetrainerError):
    """The bytes fetched for a key do not match the manifest."""


class WarmFetchError(RetrainerError):
    """A key could not be fetched and verified after bounded retries."""


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    return isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError)


def _check(entry: ManifestFile, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ChecksumMismatchError(
            f"{entry.key}: fetched {size} bytes with sha256 {digest[:16]}..., manifest says {entry.size} bytes "
            f"with sha256 {entry.sha256[:16]}... (object changed behind the manifest?)")


def _open_tmp(tmp: Path) -> int:
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def _finish(fd: int, tmp: Path, final: Path) -> int:
    """fsync, close and rename into place; returns the final file's mtime_ns for the record."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)
    return os.stat(final).st_mtime_ns


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def commit_bytes(entry: ManifestFile, data: bytes, tmp: Path, final: Path) -> int:
    """Verify a whole object held in memory, then write it durably under its final name."""
    _check(entry, len(data), hashlib.sha256(data).hexdigest())
    fd = _open_tmp(tmp)
    try:
        _write_all(fd, data, 0)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return _finish(fd, tmp, final)


class Fetcher:
    """Fetch a list of manifest entries from `root` on `fs` into the dataset directory."""

    def __init__(self, fs: Any, root: str, dataset_dir: Path, partial_dir: Path, *, max_workers: int,
                 on_done: Callable[[ManifestFile, int], None], on_retry: Callable[[], None],
                 part_size: int = PART_SIZE, attempts: int = ATTEMPTS) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.dataset_dir = dataset_dir
        self.partial_dir = partial_dir
        self.max_workers = max_workers
        self.on_done = on_done  # (entry, mtime_ns), called once per committed file
        self.on_retry = on_retry
        self.part_size = part_size
        self.attempts = attempts
        self._http: _PresignedGet | None = None
        self._batcher: _CommitBatcher

    def src(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def tmp(self, entry: ManifestFile) -> Path:
        return self.partial_dir / f"{uuid.uuid4().hex}.part"

    def final(self, entry: ManifestFile) -> Path:
        return self.dataset_dir / entry.key

    def _retrying_kw(self) -> dict[str, Any]:
        def before_sleep(state: Any) -> None:
            self.on_retry()
            exc = state.outcome.exception() if state.outcome else None
            log.warning("warm: retrying (attempt %d failed): %s", state.attempt_number, exc)

        return {"stop": stop_after_attempt(self.attempts), "wait": wait_exponential(multiplier=0.2, max=3),
                "retry": retry_if_exception(retryable), "reraise": True, "before_sleep": before_sleep}

    def run(self, entries: Iterable[ManifestFile]) -> None:
        entries = list(entries)
        if not entries:
            return
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        if getattr(self.fs, "async_impl", False):
            from fsspec.asyn import sync

            sync(self.fs.loop, self._run_async, entries)
        else:
            self._run_threads(entries)

    # ------------------------------------------------------------ async filesystems

    async def _run_async(self, entries: list[ManifestFile]) -> None:
        sem = asyncio.Semaphore(self.max_workers)
        self._http = await _PresignedGet.create(self.fs, self.max_workers)
        try:
            await self._gather(entries, sem)
        finally:
            if self._http is not None:
                await self._http.close()

    async def _get(self, src: str, start: int | None = None, end: int | None = None) -> bytes:
        if self._http is not None and self._http.enabled:
            return await self._http.get(src, start, end)
        return await self.fs._cat_file(src, start=start, end=end)

    async def _gather(self, entries: list[ManifestFile], sem: asyncio.Semaphore) -> None:
        with ThreadPoolExecutor(max_workers=min(16, self.max_workers), thread_name_prefix="warm-disk") as pool:
            # Large objects first: their parts keep the pipe full while small ones fill gaps.
            order = sorted(entries, key=lambda e: -e.size)
            self._batcher = _CommitBatcher(pool, self.partial_dir)
            tasks = [asyncio.ensure_future(self._one_async(e, sem, pool)) for e in order]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _one_async(self, entry: ManifestFile, sem: asyncio.Semaphore, pool: ThreadPoolExecutor) -> None:
        try:
            async for attempt in AsyncRetrying(**self._retrying_kw()):
                with attempt:
                    if entry.size > self.part_size:
                        mtime = await self._large_async(entry, sem, pool)
                    else:
                        async with sem:
                            data = await self._get(self.src(entry.key))
                        if entry.size <= BATCH_MAX_OBJECT:
                            _check(entry, len(data), hashlib.sha256(data).hexdigest())
                            mtime = await self._batcher.commit(data, self.tmp(entry), self.final(entry))
                        else:
                            mtime = await asyncio.get_running_loop().run_in_executor(
                                pool, commit_bytes, entry, data, self.tmp(entry), self.final(entry))
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise WarmFetchError(f"warm failed for key {entry.key!r}: {exc}") from exc
        self.on_done(entry, mtime)

    async def _large_async(self, entry: ManifestFile, sem: asyncio.Semaphore, pool: ThreadPoolExecutor) -> int:
        loop = asyncio.get_running_loop()
        src = self.src(entry.key)

        async def part(start: int, end: int) -> bytes:
            async with sem:
                data = await self._get(src, start, end)
            if len(data) != end - start:
                raise ChecksumMismatchError(f"{entry.key}: range {start}-{end} returned {len(data)} bytes")
            return data

        # A longer object is a changed object: ranged reads alone would not notice.
        async with sem:
            remote_size = int((await self.fs._info(src))["size"])
        if remote_size != entry.size:
            raise ChecksumMismatchError(f"{entry.key}: object is {remote_size} bytes, manifest says {entry.size}")
        ranges = iter([(s, min(s + self.part_size, entry.size)) for s in range(0, entry.size, self.part_size)])
        window: collections.deque[asyncio.Future[bytes]] = collections.deque()
        tmp, final = self.tmp(entry), self.final(entry)
        h = hashlib.sha256()
        fd = _open_tmp(tmp)
        offset = 0
        try:
            for r in ranges:
                window.append(asyncio.ensure_future(part(*r)))
                if len(window) >= PART_WINDOW:
                    break
            while window:
                data = await window.popleft()
                nxt = next(ranges, None)
                if nxt is not None:
                    window.append(asyncio.ensure_future(part(*nxt)))
                await loop.run_in_executor(pool, _write_and_hash, fd, data, offset, h)
                offset += len(data)
            _check(entry, offset, h.hexdigest())
        except BaseException:
            for t in window:
                t.cancel()
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return await loop.run_in_executor(pool, _finish, fd, tmp, final)

    # ------------------------------------------------------------ other filesystems

    def _run_threads(self, entries: list[ManifestFile]) -> None:
        with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="warm") as pool:
            futures = [pool.submit(self._one_sync, e) for e in entries]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def _one_sync(self, entry: ManifestFile) -> None:
        try:
            for attempt in Retrying(**self._retrying_kw()):
                with attempt:
                    mtime = self._stream_sync(entry)
        except Exception as exc:
            raise WarmFetchError(f"warm failed for key {entry.key!r}: {exc}") from exc
        self.on_done(entry, mtime)

    def _stream_sync(self, entry: ManifestFile) -> int:
        tmp, final = self.tmp(entry), self.final(entry)
        h = hashlib.sha256()
        fd = _open_tmp(tmp)
        offset = 0
        try:
            with self.fs.open(self.src(entry.key), "rb") as fh:
                while chunk := fh.read(4 << 20):
                    _write_and_hash(fd, chunk, offset, h)
                    offset += len(chunk)
            _check(entry, offset, h.hexdigest())
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return _finish(fd, tmp, final)


def _write_and_hash(fd: int, data: bytes, offset: int, h: Any) -> None:
    h.update(data)
    _write_all(fd, data, offset)


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


def _commit_batch(items: list[tuple[bytes, Path, Path]], partial_dir: Path) -> list[int]:
    """Write verified small objects to temp names, make them durable with one syncfs, then rename them all.

    Same guarantee as per-file fsync + rename (no rename before the data is on disk), one flush per batch.
    """
    fds: list[int] = []
    try:
        for data, tmp, _final in items:
            fd = _open_tmp(tmp)
            fds.append(fd)
            _write_all(fd, data, 0)
        if not _syncfs(partial_dir):
            for fd in fds:
                os.fsync(fd)
    except BaseException:
        for (_d, tmp, _f) in items:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    mtimes = []
    for _data, tmp, final in items:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        mtimes.append(os.stat(final).st_mtime_ns)
    return mtimes


class _CommitBatcher:
    """Collect verified small objects on the event loop; commit them in batches on the disk pool.

    Fewer thread handoffs keep the event loop (which does the network I/O) from waiting on the GIL.
    """

    def __init__(self, pool: ThreadPoolExecutor, partial_dir: Path) -> None:
        self.pool = pool
        self.partial_dir = partial_dir
        self.items: list[tuple[bytes, Path, Path]] = []
        self.futures: list[asyncio.Future[int]] = []
        self.timer: asyncio.TimerHandle | None = None

    def commit(self, data: bytes, tmp: Path, final: Path) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self.items.append((data, tmp, final))
        self.futures.append(fut)
        if len(self.items) >= BATCH_FILES:
            self.flush()
        elif self.timer is None:
            self.timer = loop.call_later(0.01, self.flush)
        return fut

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.items:
            return
        items, futures = self.items, self.futures
        self.items, self.futures = [], []
        job = asyncio.get_running_loop().run_in_executor(self.pool, _commit_batch, items, self.partial_dir)

        def done(j: asyncio.Future[list[int]]) -> None:
            exc = j.exception() if not j.cancelled() else asyncio.CancelledError()
            for i, f in enumerate(futures):
                if f.done():
                    continue
                if exc is not None:
                    f.set_exception(exc)
                else:
                    f.set_result(j.result()[i])

        job.add_done_callback(done)


class _PresignedGet:
    """S3 GETs as presigned URLs over a plain aiohttp session.

    botocore spends ~2 ms of CPU per request (events, parsing); signing a URL costs a
    fraction of that, so for many small objects this roughly doubles throughput.
    Any answer other than 200/206/404 switches back to s3fs for the rest of the warm.
    Disabled with RETRAINER_WARM_PRESIGNED=0 or when the client options set TLS
    verification or other custom transport settings.
    """

    def __init__(self, fs: Any, client: Any, session: Any) -> None:
        self.fs = fs
        self.client = client
        self.session = session
        self.enabled = True

    @classmethod
    async def create(cls, fs: Any, limit: int) -> _PresignedGet | None:
        if os.environ.get("RETRAINER_WARM_PRESIGNED", "1") == "0" or "s3" not in fs.protocol:
            return None
        if set(getattr(fs, "client_kwargs", None) or {}) - {"endpoint_url", "region_name"}:
            return None
        try:
            import aiohttp

            client = await fs.set_session()
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                            timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=120))
        except Exception as exc:  # optional accelerator: s3fs alone still works
            log.debug("warm: presigned GETs unavailable (%s); using s3fs", exc)
            return None
        return cls(fs, client, session)

    async def get(self, src: str, start: int | None, end: int | None) -> bytes:
        bucket, key, _ = self.fs.split_path(src)
        url = await self.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                       ExpiresIn=3600)
        headers = {"Range": f"bytes={start}-{end - 1}"} if start is not None and end is not None else None
        async with self.session.get(url, headers=headers) as resp:
            if resp.status in (200, 206):
                return await resp.read()
            if resp.status == 404:
                raise FileNotFoundError(src)
            if self.enabled:
                self.enabled = False
                log.warning("warm: presigned GET answered HTTP %d; using s3fs requests from now on", resp.status)
            raise OSError(f"GET {src}: HTTP {resp.status}")

    async def close(self) -> None:
        await self.session.close()
