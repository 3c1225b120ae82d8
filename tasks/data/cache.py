"""Cache layout, the per-dataset locks, and LRU eviction under a disk budget.

Layout under a cache root (the dataset directory shape is a contract with train/evaluate):

    datasets/<manifest_hash[:16]>/   manifest.json + every file at its key
    partial/<id>/                    temporary downloads (same filesystem: rename is atomic)
    state/<id>.json, <id>.journal    record of verified digests (see state.py)
    state/<id>.used                  mtime = last use (LRU order)
    state/<id>.size                  bytes the dataset takes when complete (counted while it is still arriving)
    packed/<id>/                     a chat dataset's windows as the node's warm packed them (tasks/data/packing.py)
    locks/<id>.warm.lock             exclusive while a warm writes the dataset
    locks/<id>.use.lock              shared while a dataset is in use (trainer, warm); eviction needs it exclusive
    locks/evict.lock                 exclusive while one warm evicts to fit its dataset

All are `flock` locks: they die with their holder, so a SIGKILLed trainer or warm never pins a dataset
forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.base.errors import RetrainerError
from tasks.base.fsutil import dir_bytes

log = logging.getLogger("tasks.data.warm")


class DiskBudgetError(RetrainerError):
    """The dataset cannot fit in the cache's disk budget (checked before any download)."""


class DatasetEvictedError(RetrainerError):
    """The dataset was evicted before it could be marked in use; warm it again."""


@dataclass(frozen=True)
class CacheLayout:
    root: Path

    @staticmethod
    def dataset_id(manifest_hash: str) -> str:
        return manifest_hash[:16]

    def dataset_dir(self, dsid: str) -> Path:
        return self.root / "datasets" / dsid

    def packing_dir(self, dsid: str) -> Path:
        return self.root / "packed" / dsid

    def partial_dir(self, dsid: str) -> Path:
        return self.root / "partial" / dsid

    def state_path(self, dsid: str) -> Path:
        return self.root / "state" / f"{dsid}.json"

    def journal_path(self, dsid: str) -> Path:
        return self.root / "state" / f"{dsid}.journal"

    def used_stamp(self, dsid: str) -> Path:
        return self.root / "state" / f"{dsid}.used"

    def size_path(self, dsid: str) -> Path:
        return self.root / "state" / f"{dsid}.size"

    def reserve(self, dsid: str, nbytes: int) -> None:
        """Record the dataset's complete size, so that concurrent warms count it before its bytes land."""
        path = self.size_path(dsid)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(str(nbytes))
        os.replace(tmp, path)
        self.dataset_dir(dsid).mkdir(parents=True, exist_ok=True)  # listed by dataset_ids() from now on

    def reserved(self, dsid: str) -> int:
        try:
            return int(self.size_path(dsid).read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def warm_lock_path(self, dsid: str) -> Path:
        return self.root / "locks" / f"{dsid}.warm.lock"

    def use_lock_path(self, dsid: str) -> Path:
        return self.root / "locks" / f"{dsid}.use.lock"

    def evict_lock_path(self) -> Path:
        return self.root / "locks" / "evict.lock"

    def ensure(self) -> None:
        for sub in ("datasets", "partial", "state", "locks", "trash"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def dataset_ids(self) -> list[str]:
        d = self.root / "datasets"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def touch_used(self, dsid: str) -> None:
        stamp = self.used_stamp(dsid)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        os.utime(stamp)

    def last_used_ns(self, dsid: str) -> int:
        for p in (self.used_stamp(dsid), self.dataset_dir(dsid)):
            with contextlib.suppress(FileNotFoundError):
                return p.stat().st_mtime_ns
        return 0


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def warm_lock(layout: CacheLayout, dsid: str, *, wait: bool = True) -> Iterator[bool]:
    """Exclusive right to write a dataset; yields False at once (wait=False) if another warm holds it."""
    path = layout.warm_lock_path(dsid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
            if wait:
                log.info("warm: dataset %s is being warmed by another process; waiting for its lock", dsid)
                fcntl.flock(fd, fcntl.LOCK_EX)
                held = True
        yield held
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def use_lock(layout: CacheLayout, dsid: str) -> Iterator[None]:
    """Shared hold on a dataset (many readers); blocks only while an eviction holds it exclusively."""
    with _flock(layout.use_lock_path(dsid), fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def dataset_in_use(dataset_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold a warmed dataset "in use" (e.g. for a training run): eviction never removes it meanwhile."""
    dataset_dir = Path(dataset_dir)
    layout = CacheLayout(dataset_dir.parent.parent)
    dsid = dataset_dir.name
    with use_lock(layout, dsid):
        if not (dataset_dir / "manifest.json").is_file():
            raise DatasetEvictedError(f"{dataset_dir}: not a warm dataset (evicted or never warmed); warm it again")
        layout.touch_used(dsid)
        yield dataset_dir


def cache_of(dataset_dir: str | os.PathLike[str]) -> CacheLayout | None:
    """The cache that holds `dataset_dir` as one of its datasets; None for a dataset directory outside a cache."""
    path = Path(dataset_dir)
    layout = CacheLayout(path.parent.parent)
    return layout if layout.dataset_dir(path.name) == path else None


def sibling_dataset_dir(dataset_dir: str | os.PathLike[str], manifest_hash: str) -> Path | None:
    """Where the dataset of `manifest_hash` lives in the cache that holds `dataset_dir`: every source of a
    training mixture is warmed into the same cache, on every node, so the ranks find each one from the
    primary's directory (whichever node's it is). None where `dataset_dir` is not in a cache."""
    layout = cache_of(dataset_dir)
    return None if layout is None else layout.dataset_dir(layout.dataset_id(manifest_hash))


def try_evict(layout: CacheLayout, dsid: str) -> bool:
    """Remove one dataset unless it is in use; True if removed."""
    fd = os.open(layout.use_lock_path(dsid), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        remove_dataset(layout, dsid)
        return True
    finally:
        os.close(fd)


def remove_dataset(layout: CacheLayout, dsid: str) -> None:
    """Every trace of a dataset in the cache: its directory (renamed aside first: readers see all or nothing),
    its record and stamps, its partial downloads. The caller holds it exclusively (eviction), or holds its warm
    lock while no reader can use it (no manifest copy yet: a dataset refused before it was ever complete)."""
    layout.ensure()
    trash = layout.root / "trash" / f"{dsid}-{os.urandom(4).hex()}"
    with contextlib.suppress(FileNotFoundError):
        os.rename(layout.dataset_dir(dsid), trash)  # atomic: readers see all or nothing
    for p in (layout.state_path(dsid), layout.journal_path(dsid), layout.used_stamp(dsid), layout.size_path(dsid)):
        p.unlink(missing_ok=True)
    shutil.rmtree(layout.partial_dir(dsid), ignore_errors=True)
    shutil.rmtree(layout.packing_dir(dsid), ignore_errors=True)
    shutil.rmtree(trash, ignore_errors=True)


def reserve_room(layout: CacheLayout, dsid: str, dataset_bytes: int) -> None:
    """Reserve a dataset's size without a budget of its own, so that budgeted warms next to it count it."""
    with _flock(layout.evict_lock_path(), fcntl.LOCK_EX):
        layout.reserve(dsid, dataset_bytes)


def make_room(layout: CacheLayout, dsid: str, dataset_bytes: int, budget: int) -> list[str]:
    """Evict least-recently-used datasets (never in-use ones) until `dataset_bytes` fits; returns evicted ids.

    The caller holds `dsid` in use, so it is never a candidate for another warm's eviction. Its size
    is reserved under the eviction lock, and every other dataset counts at least its reserved size:
    two warms of different datasets cannot both fit into room that holds only one.
    """
    if dataset_bytes > budget:
        raise DiskBudgetError(f"dataset {dsid} needs {dataset_bytes} bytes, more than the cache budget "
                              f"of {budget} bytes ({layout.root}); nothing was downloaded")
    evicted: list[str] = []
    with _flock(layout.evict_lock_path(), fcntl.LOCK_EX):
        others = {d: max(dir_bytes(layout.dataset_dir(d)) + dir_bytes(layout.partial_dir(d)), layout.reserved(d))
                  + dir_bytes(layout.packing_dir(d)) for d in layout.dataset_ids() if d != dsid}
        used = sum(others.values())
        in_use: list[str] = []
        for other in sorted(others, key=layout.last_used_ns):
            if used + dataset_bytes <= budget:
                break
            if try_evict(layout, other):
                log.info("warm: evicted dataset %s (%d bytes) to fit the disk budget", other, others[other])
                used -= others[other]
                evicted.append(other)
            else:
                in_use.append(other)
        if used + dataset_bytes > budget:
            raise DiskBudgetError(
                f"dataset {dsid} needs {dataset_bytes} bytes; cache {layout.root} holds {used} bytes of datasets "
                f"in use ({', '.join(in_use) or 'none'}) under a budget of {budget} bytes; nothing was downloaded")
        layout.reserve(dsid, dataset_bytes)
    return evicted
