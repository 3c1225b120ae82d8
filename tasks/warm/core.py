"""`warm()`: make a verified local copy of a dataset from any fsspec URL into a cache root.

Steps, under the dataset's warm lock (a second warm of the same dataset waits, then
finds every file already verified and fetches nothing):
1. read + validate the manifest (its hash names the dataset dir);
2. hold the dataset in use, check the disk budget and evict LRU datasets if needed
   (a dataset bigger than the budget fails here, before any download);
3. skip files recorded as verified (size + mtime unchanged), re-hash present but
   unrecorded files locally (after a crash) or all files with `verify=True`;
4. fetch the rest (fetch.py), record each as it lands, then fsync directories,
   write the manifest copy and the compacted record.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import Timeout

from tasks.data import MANIFEST_KEY, Manifest, ManifestFile
from tasks.errors import InvalidInputError, RetrainerError
from tasks.fsutil import atomic_write_bytes, fsync_dir, sha256_file
from tasks.warm.cache import CacheLayout, make_room, use_lock
from tasks.warm.fetch import PART_SIZE, Fetcher
from tasks.warm.report import Progress, WarmReport, WarmResult
from tasks.warm.state import VerifiedRecord

if TYPE_CHECKING:
    from tasks.config import JobConfig

log = logging.getLogger("tasks.warm")

DEFAULT_WORKERS = 16


def _filesystem(source_url: str, storage_options: dict[str, Any] | None, max_workers: int) -> tuple[Any, str]:
    import fsspec

    opts = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(source_url)[0]
    if protocol in ("s3", "s3a"):
        # aiobotocore's pool (10) would cap requests in flight below our semaphore.
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("max_pool_connections", max_workers)
        cfg.setdefault("signature_version", "s3v4")  # presigned URLs (fetch.py) default to SigV2 otherwise
        opts["config_kwargs"] = cfg
    fs, root = fsspec.core.url_to_fs(source_url, **opts)
    fs.invalidate_cache()
    return fs, root


def _read_manifest_bytes(fs: Any, path: str, source_url: str, manifest_key: str,
                         storage_options: dict[str, Any] | None) -> bytes:
    """Read the manifest; any failure becomes one line naming the URL and endpoint.

    No retry loop of our own here: s3fs/botocore already retry connection errors, and a second
    layer would multiply the time a warm takes to give up on an endpoint that is down.
    """
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise InvalidInputError(f"{source_url}: manifest {manifest_key!r} not found") from None
    except Exception as exc:
        endpoint = ((storage_options or {}).get("client_kwargs") or {}).get("endpoint_url")
        where = f" (endpoint {endpoint})" if endpoint else ""
        raise RetrainerError(f"{source_url}{where}: cannot read manifest {manifest_key!r}: "
                             f"{type(exc).__name__}: {exc}") from None


def _local_target(dataset_dir: Path, key: str) -> Path:
    """Map a key to its path; refuse anything that would land outside the dataset dir."""
    base = os.path.normpath(dataset_dir)
    target = os.path.normpath(os.path.join(base, key))
    if not target.startswith(base + os.sep) or "\x00" in key:
        raise InvalidInputError(f"manifest key {key!r} escapes the cache directory; refused")
    return Path(target)


def warm(
    source_url: str,
    cache_root: str | os.PathLike[str],
    *,
    manifest_key: str = MANIFEST_KEY,
    storage_options: dict[str, Any] | None = None,
    disk_budget_bytes: int | None = None,
    verify: bool = False,
    max_workers: int | None = None,
    progress: bool = True,
    part_size: int | None = None,
) -> WarmResult:
    """Warm the dataset at `source_url` into `<cache_root>/datasets/<manifest_hash[:16]>/`.

    `part_size`: objects larger than this are fetched as parallel ranged parts (default 16 MiB).
    """
    t0 = time.monotonic()
    workers = max_workers or DEFAULT_WORKERS
    fs, root = _filesystem(source_url, storage_options, workers)
    root = root.rstrip("/")
    manifest_src = f"{root}/{manifest_key}" if root else manifest_key
    raw = _read_manifest_bytes(fs, manifest_src, source_url, manifest_key, storage_options)
    manifest = Manifest.parse(raw, source=f"{source_url.rstrip('/')}/{manifest_key}")
    mhash = manifest.hash
    layout = CacheLayout(Path(cache_root).resolve())
    layout.ensure()
    dsid = layout.dataset_id(mhash)
    dataset_dir = layout.dataset_dir(dsid)
    targets = {f.key: _local_target(dataset_dir, f.key) for f in manifest.files}
    report = WarmReport(files_total=len(manifest.files), bytes_total=manifest.total_bytes)

    with use_lock(layout, dsid):
        lock = layout.warm_lock(dsid)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            log.info("warm: dataset %s is being warmed by another process; waiting for its lock", dsid)
            lock.acquire()
        try:
            if disk_budget_bytes is not None:
                report.evicted = make_room(layout, dsid, manifest.total_bytes, disk_budget_bytes)
            dataset_dir.mkdir(parents=True, exist_ok=True)
            layout.touch_used(dsid)
            partial = layout.partial_dir(dsid)
            shutil.rmtree(partial, ignore_errors=True)  # leftovers of a killed warm; we hold the lock
            record = VerifiedRecord(layout.state_path(dsid), layout.journal_path(dsid), mhash).load()
            try:
                t1 = time.monotonic()
                to_fetch = _reuse_local(manifest, targets, record, report, verify, workers)
                t2 = time.monotonic()
                _fetch(fs, root, dataset_dir, partial, to_fetch, record, report, workers, progress,
                       part_size or PART_SIZE)
                t3 = time.monotonic()
                if report.files_skipped < report.files_total or report.files_verified or not _same_bytes(
                        dataset_dir / MANIFEST_KEY, raw) or record.journal_path.exists():
                    for d in sorted({targets[f.key].parent for f in manifest.files} | {dataset_dir}):
                        fsync_dir(d)
                    atomic_write_bytes(dataset_dir / MANIFEST_KEY, raw)
                    record.compact({f.key for f in manifest.files})
                # else: a no-op re-warm; the record and the manifest copy are already durable.
                log.debug("warm: phases: manifest+locks %.3f s, local check %.3f s, fetch %.3f s, commit %.3f s",
                          t1 - t0, t2 - t1, t3 - t2, time.monotonic() - t3)
            finally:
                record.close()
            shutil.rmtree(partial, ignore_errors=True)
            layout.touch_used(dsid)
        finally:
            lock.release()

    report.seconds = time.monotonic() - t0
    log.info("warm: dataset %s ready at %s: fetched %d files / %.1f MB, skipped %d, verified %d, %.2f s, %.1f MB/s",
             dsid, dataset_dir, report.files_fetched, report.bytes_fetched / 1e6, report.files_skipped,
             report.files_verified, report.seconds, report.mb_per_s)
    return WarmResult(dataset_dir=dataset_dir, manifest_hash=mhash, report=report, manifest=manifest)


def _same_bytes(path: Path, raw: bytes) -> bool:
    try:
        return path.read_bytes() == raw
    except FileNotFoundError:
        return False


def _reuse_local(manifest: Manifest, targets: dict[str, Path], record: VerifiedRecord, report: WarmReport,
                 verify: bool, workers: int) -> list[ManifestFile]:
    """Sort files into skip / re-hash locally / fetch; returns the ones to fetch."""
    to_hash: list[ManifestFile] = []
    to_fetch: list[ManifestFile] = []
    for f in manifest.files:
        path = targets[f.key]
        if not verify and record.trusted(f.key, f.size, f.sha256, path):
            report.files_skipped += 1
            report.bytes_skipped += f.size
        elif path.is_file():
            to_hash.append(f)
        else:
            to_fetch.append(f)
    if not to_hash:
        return to_fetch

    def check(f: ManifestFile) -> bool:
        path = targets[f.key]
        st = os.stat(path)
        if st.st_size == f.size and sha256_file(path) == f.sha256:
            record.add(f.key, f.size, f.sha256, st.st_mtime_ns)
            return True
        log.warning("warm: local copy of %s does not match the manifest; fetching it again", f.key)
        path.unlink(missing_ok=True)
        return False

    with ThreadPoolExecutor(max_workers=min(4, workers)) as pool:
        for f, ok in zip(to_hash, pool.map(check, to_hash), strict=True):
            report.files_verified += 1
            report.bytes_verified += f.size
            if ok:
                report.files_skipped += 1
                report.bytes_skipped += f.size
            else:
                to_fetch.append(f)
    return to_fetch


def _fetch(fs: Any, root: str, dataset_dir: Path, partial: Path, entries: list[ManifestFile],
           record: VerifiedRecord, report: WarmReport, workers: int, progress: bool, part_size: int) -> None:
    if not entries:
        return
    bar = Progress(sum(f.size for f in entries), len(entries), enabled=progress)
    lock = threading.Lock()

    def done(entry: ManifestFile, mtime_ns: int) -> None:
        record.add(entry.key, entry.size, entry.sha256, mtime_ns)
        with lock:
            report.files_fetched += 1
            report.bytes_fetched += entry.size
        bar.update(entry.size)

    def retried() -> None:
        with lock:
            report.retries += 1

    try:
        Fetcher(fs, root, dataset_dir, partial, max_workers=workers, on_done=done, on_retry=retried,
                part_size=part_size).run(entries)
    finally:
        bar.close()


def warm_for_config(cfg: JobConfig, **kw: Any) -> WarmResult:
    """Warm the dataset a job config names (data.source_url, manifest, cache_dir, budget, storage options)."""
    d = cfg.data
    kw.setdefault("manifest_key", d.manifest)
    kw.setdefault("storage_options", d.storage_options)
    kw.setdefault("disk_budget_bytes", d.disk_budget_bytes)
    result = warm(d.source_url, d.cache_dir, **kw)
    # A training dataset needs both splits; refuse it here, before any rank starts on it.
    for split in ("train", "heldout"):
        if not result.manifest.split(split):
            raise InvalidInputError(f"{d.source_url.rstrip('/')}/{d.manifest}: manifest lists no {split}/ files: "
                                    f"nothing to {'train' if split == 'train' else 'evaluate'} on")
    return result
