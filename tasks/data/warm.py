"""`warm()`: make a verified local copy of a dataset from any fsspec URL into a cache root.

Steps, under the dataset's warm lock (a second warm of the same dataset waits, then
finds every file already verified and fetches nothing):
1. read the manifest (its hash names the dataset dir);
2. if the cache holds a complete warm of these exact manifest bytes and every file is
   still the one recorded (size + mtime), stop: a no-op re-warm imports neither
   pydantic nor fsspec and costs a stat per file;
3. otherwise validate the manifest and check it against the model that reads it (its
   splits hold tokens, its vocabulary fits: tasks/data/tokens.py), hold the dataset in
   use, check the disk budget and evict LRU datasets if needed (a dataset bigger than the
   budget fails here, before any download);
4. skip files recorded as verified, re-hash present but unrecorded files locally
   (after a crash) or all files with `verify=True`;
5. fetch the rest (tasks/fetch), record each as it lands, then fsync directories,
   write the manifest copy and the compacted record.
Every file's largest token id is found in the pass that hashes it and kept in the record:
a file the model cannot read is refused before it is committed (steps 4-5), or from the
record when it is cached already (steps 2 and 4).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.dataset_format import MANIFEST_KEY, manifest_hash, token_bytes
from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.fsutil import atomic_write_bytes, fsync_dir, sha256_file
from tasks.base.object_source import ObjectSource, open_source
from tasks.data.cache import (
    CacheLayout,
    dataset_in_use,
    make_room,
    remove_dataset,
    reserve_room,
    use_lock,
    warm_lock,
)
from tasks.data.packing import write_packing
from tasks.data.report import Progress, WarmReport, WarmResult
from tasks.data.sources import DataSource, training_sources
from tasks.data.tokens import ShardCheck, ShardRules, Tokens
from tasks.data.warm_state import VerifiedRecord, complete_record, tokens_of
from tasks.fetch.retry import with_retries

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig
    from tasks.data.manifest import Manifest, ManifestFile

log = logging.getLogger("tasks.data.warm")

DEFAULT_WORKERS = 16


def _read_manifest_bytes(source: ObjectSource, source_url: str, manifest_key: str) -> bytes:
    """Read the manifest, retried like every file (a few seconds of outage pass unnoticed).

    Any failure becomes one line naming the URL and endpoint; a missing manifest is bad input.
    """
    def retried(attempt: int, exc: BaseException) -> None:
        log.warning("warm: reading the manifest failed (attempt %d), retrying: %s", attempt, _first_line(exc))

    try:
        return with_retries(lambda: bytes(source.read(manifest_key)), retried)
    except FileNotFoundError:
        raise InvalidInputError(f"{source_url}: manifest {manifest_key!r} not found") from None
    except InvalidInputError:
        raise
    except Exception as exc:
        raise RetrainerError(f"{source.name}: cannot read manifest {manifest_key!r}: "
                             f"{type(exc).__name__}: {_first_line(exc)}") from None


def remote_manifest_hash(source_url: str, manifest_key: str = MANIFEST_KEY,
                         storage_options: dict[str, Any] | None = None) -> str:
    """The hash of the manifest at the source as it is now (the dataset a run about to start will train on)."""
    source = open_source(source_url, storage_options, 1)
    return manifest_hash(_read_manifest_bytes(source, source_url, manifest_key))


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else ""


def _local_target(dataset_dir: Path, key: str) -> str:
    """Map a key to its path; refuse anything that would land outside the dataset dir."""
    base = os.path.normpath(dataset_dir)
    target = os.path.normpath(os.path.join(base, key))
    if not target.startswith(base + os.sep) or "\x00" in key:
        raise InvalidInputError(f"manifest key {key!r} escapes the cache directory; refused")
    return target


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
    rules: ShardRules | None = None,
    seq_len: int | None = None,
) -> WarmResult:
    """Warm the dataset at `source_url` into `<cache_root>/datasets/<manifest_hash[:16]>/`.

    `part_size`: objects larger than this are fetched as parallel ranged parts (default 16 MiB).
    `rules`: what the model that will read the dataset needs of it (none: the tokens are only recorded).
    `seq_len`: the model's; a chat dataset's splits in `rules` are then packed into its windows for the ranks.
    """
    t0 = time.monotonic()
    workers = max_workers or DEFAULT_WORKERS
    source = open_source(source_url, storage_options, workers)
    raw = _read_manifest_bytes(source, source_url, manifest_key)
    mhash = manifest_hash(raw)
    manifest_source = f"{source_url.rstrip('/')}/{manifest_key}"
    rules = rules or ShardRules()
    where = f"{manifest_source} ({rules.field})" if rules.field else manifest_source
    layout = CacheLayout(Path(cache_root).resolve())
    dsid = layout.dataset_id(mhash)
    dataset_dir = layout.dataset_dir(dsid)
    result = WarmResult(dataset_dir=dataset_dir, manifest_hash=mhash, report=WarmReport(), manifest_raw=raw,
                        manifest_source=manifest_source)

    report = None
    if not verify and _same_bytes(dataset_dir / MANIFEST_KEY, raw):  # the no-op candidate; nothing written yet
        with use_lock(layout, dsid), warm_lock(layout, dsid, wait=False) as held:
            report = _already_warm(layout, dsid, raw, rules, where) if held else None
            if report is not None:
                layout.touch_used(dsid)
    if report is None:
        from tasks.data.manifest import Manifest  # lazy: pydantic only when the manifest must be parsed

        result.parsed = manifest = Manifest.parse(raw, source=manifest_source)  # refused before any write
        check = ShardCheck(rules, where, manifest.dtype, manifest.vocab_size)
        check.refuse_manifest({f.key: f.size for f in manifest.files})
        layout.ensure()
        with use_lock(layout, dsid), warm_lock(layout, dsid):
            try:
                report = _warm_files(source, layout, dsid, manifest, raw, check, disk_budget_bytes, verify,
                                     workers, progress, part_size, t0)
            except InvalidInputError:
                if not (dataset_dir / MANIFEST_KEY).exists():  # never complete, so nobody reads it
                    remove_dataset(layout, dsid)  # a refused dataset leaves nothing under a final name
                raise

    if seq_len is not None:
        _pack_chat_splits(layout, dsid, result, rules.splits, seq_len)
    report.seconds = time.monotonic() - t0
    result.report = report
    log.info("warm: dataset %s ready at %s: fetched %d files / %.1f MB, skipped %d, verified %d, %.2f s, %.1f MB/s",
             dsid, dataset_dir, report.files_fetched, report.bytes_fetched / 1e6, report.files_skipped,
             report.files_verified, report.seconds, report.mb_per_s)
    return result


def _pack_chat_splits(layout: CacheLayout, dsid: str, result: WarmResult, splits: tuple[str, ...],
                      seq_len: int) -> None:
    """A chat dataset's splits the run reads, packed into windows of `seq_len + 1` tokens once, here, for every
    rank of the node to map (tasks/data/packing.py); the dataset held in use meanwhile."""
    if json.loads(result.manifest_raw).get("chat") is None:  # no pydantic for a plain-text re-warm
        return
    manifest = result.manifest
    width, started, shards = token_bytes(manifest.dtype), time.monotonic(), 0
    with use_lock(layout, dsid):
        for split in splits:
            for entry in manifest.split(split):
                if entry.size and write_packing(result.dataset_dir, entry.key, entry.size // width, seq_len + 1):
                    shards += 1
    if shards:
        log.info("warm: packed %d chat shard(s) of dataset %s into windows of %d tokens in %.2f s", shards, dsid,
                 seq_len + 1, time.monotonic() - started)


def _already_warm(layout: CacheLayout, dsid: str, raw: bytes, rules: ShardRules, where: str) -> WarmReport | None:
    """The report of a no-op re-warm, or None if anything needs a real warm.

    True only when an earlier warm of these exact manifest bytes completed (its manifest copy
    and complete record are written last, its journal removed) and every file still has the
    recorded size and mtime. That warm validated those bytes, so nothing is parsed here; the
    model's rules are checked against the record (its recorded token ids), nothing is read.
    """
    dataset_dir = layout.dataset_dir(dsid)
    if not _same_bytes(dataset_dir / MANIFEST_KEY, raw):
        return None
    record = complete_record(layout.state_path(dsid), layout.journal_path(dsid), manifest_hash(raw))
    if record is None:
        return None
    total = 0
    base = str(dataset_dir)
    for key, (size, _sha256, mtime_ns, _max_id, _wider) in record.files.items():
        try:
            st = os.stat(f"{base}/{key}")
        except FileNotFoundError:
            return None
        if st.st_size != size or st.st_mtime_ns != mtime_ns:
            return None
        total += size
    record.refuse_unreadable(rules, where)
    return WarmReport(files_total=len(record.files), bytes_total=total, files_skipped=len(record.files),
                      bytes_skipped=total)


def _warm_files(source: ObjectSource, layout: CacheLayout, dsid: str, manifest: Manifest, raw: bytes,
                check: ShardCheck, disk_budget_bytes: int | None, verify: bool, workers: int, progress: bool,
                part_size: int | None, t0: float) -> WarmReport:
    """Under the warm lock: make room, reuse what is verified, fetch the rest, commit the record."""
    from tasks.fetch.fetcher import PART_SIZE  # lazy: a no-op re-warm never loads the fetcher and its retry library

    dataset_dir = layout.dataset_dir(dsid)
    targets = {f.key: _local_target(dataset_dir, f.key) for f in manifest.files}
    report = WarmReport(files_total=len(manifest.files), bytes_total=manifest.total_bytes)
    if disk_budget_bytes is not None:
        report.evicted = make_room(layout, dsid, manifest.total_bytes, disk_budget_bytes)
    else:
        reserve_room(layout, dsid, manifest.total_bytes)
    layout.touch_used(dsid)
    partial = layout.partial_dir(dsid)
    shutil.rmtree(partial, ignore_errors=True)  # leftovers of a killed warm; we hold the lock
    record = VerifiedRecord(layout.state_path(dsid), layout.journal_path(dsid), manifest_hash(raw), manifest.dtype,
                            manifest.vocab_size).load()
    try:
        t1 = time.monotonic()
        to_fetch = _reuse_local(manifest, targets, record, report, check, verify, workers)
        t2 = time.monotonic()
        _fetch(source, dataset_dir, partial, to_fetch, record, report, check, workers, progress,
               part_size or PART_SIZE)
        t3 = time.monotonic()
        if report.files_skipped < report.files_total or report.files_verified or not record.complete or \
                not _same_bytes(dataset_dir / MANIFEST_KEY, raw) or record.journal_path.exists():
            for d in sorted({os.path.dirname(t) for t in targets.values()} | {str(dataset_dir)}):
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
    return report


def _same_bytes(path: Path, raw: bytes) -> bool:
    try:
        return path.read_bytes() == raw
    except FileNotFoundError:
        return False


def _reuse_local(manifest: Manifest, targets: dict[str, str], record: VerifiedRecord, report: WarmReport,
                 check: ShardCheck, verify: bool, workers: int) -> list[ManifestFile]:
    """Sort files into skip / re-hash locally / fetch; returns the ones to fetch. A file the model cannot read
    is refused from its record, or from the scan of the local re-hash."""
    to_hash: list[ManifestFile] = []
    to_fetch: list[ManifestFile] = []
    for f in manifest.files:
        path = targets[f.key]
        if not verify and record.trusted(f.key, f.size, f.sha256, path):
            check.accept(f.key, tokens_of(record.entries[f.key]))
            report.files_skipped += 1
            report.bytes_skipped += f.size
        elif os.path.isfile(path):
            to_hash.append(f)
        else:
            to_fetch.append(f)
    if not to_hash:
        return to_fetch

    def rehash(f: ManifestFile) -> bool:
        path = targets[f.key]
        st = os.stat(path)
        scan = check.scan()
        if st.st_size == f.size and sha256_file(path, scan.update) == f.sha256:
            record.add(f.key, f.size, f.sha256, st.st_mtime_ns, check.accept(f.key, scan.result()))
            return True
        log.warning("warm: local copy of %s does not match the manifest; fetching it again", f.key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return False

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(4, workers)) as pool:
        for f, ok in zip(to_hash, pool.map(rehash, to_hash), strict=True):
            report.files_verified += 1
            report.bytes_verified += f.size
            if ok:
                report.files_skipped += 1
                report.bytes_skipped += f.size
            else:
                to_fetch.append(f)
    return to_fetch


def _fetch(source: ObjectSource, dataset_dir: Path, partial: Path, entries: list[ManifestFile],
           record: VerifiedRecord, report: WarmReport, check: ShardCheck, workers: int, progress: bool,
           part_size: int) -> None:
    from tasks.fetch.fetcher import Fetcher  # lazy: a no-op re-warm never loads the fetcher and its retry library

    if not entries:
        return
    bar = Progress(sum(f.size for f in entries), len(entries), enabled=progress)
    lock = threading.Lock()

    def done(entry: ManifestFile, mtime_ns: int, tokens: Tokens) -> None:
        record.add(entry.key, entry.size, entry.sha256, mtime_ns, tokens)
        with lock:
            report.files_fetched += 1
            report.bytes_fetched += entry.size
        bar.update(entry.size)

    def retried() -> None:
        with lock:
            report.retries += 1

    try:
        Fetcher(source, dataset_dir, partial, check, max_workers=workers, label="warm",
                dest_what="the cache's dataset directory", log=log, on_done=done, on_retry=retried,
                part_size=part_size, direct=os.environ.get("RETRAINER_WARM_DIRECT", "1") != "0").run(entries)
    finally:
        bar.close()


def warm_sources(sources: list[DataSource], cache_root: str | os.PathLike[str], *, vocab_size: int | None = None,
                 disk_budget_bytes: int | None = None, **kw: Any) -> list[WarmResult]:
    """Warm the datasets a job reads into one cache, in order, each checked against the model (its
    `vocab_size`, the splits read from it) before anything of it is committed.

    Each one warmed stays held in use while the next warms, so a disk budget never evicts one source
    of a training mixture to make room for another (it fails instead, naming them in use)."""

    results: list[WarmResult] = []
    with contextlib.ExitStack() as held:
        for source in sources:
            if results:
                held.enter_context(dataset_in_use(results[-1].dataset_dir))
            results.append(warm(source.source_url, cache_root, manifest_key=source.manifest,
                                storage_options=source.storage_options, disk_budget_bytes=disk_budget_bytes,
                                rules=source.rules(vocab_size), **kw))
    return results


def warm_for_config(cfg: JobConfig, **kw: Any) -> WarmResult:
    """Warm the dataset a job config names (data.source_url, manifest, cache_dir, budget, storage options)."""
    return warm_sources(training_sources(cfg)[:1], cfg.data.cache_dir, vocab_size=cfg.model.vocab_size,
                        disk_budget_bytes=cfg.data.disk_budget_bytes, seq_len=cfg.model.seq_len, **kw)[0]


def warm_mixture(cfg: JobConfig, **kw: Any) -> list[WarmResult]:
    """Warm every source a job trains on: data.source_url first, then each `data.replay` source in order."""
    return warm_sources(training_sources(cfg), cfg.data.cache_dir, vocab_size=cfg.model.vocab_size,
                        disk_budget_bytes=cfg.data.disk_budget_bytes, seq_len=cfg.model.seq_len, **kw)
