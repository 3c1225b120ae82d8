"""Housekeeping: a run's checkpoints pruned once its version is live, and `retrainer gc` by retention policy.

Never deleted: the artifact of any registry version (every version an alias ever pointed to, and every
other one: version records are immutable, and each keeps pulling and verifying), and anything of a run
whose experiment lock is held (tried without waiting; the run is skipped and the report says so; gc holds
the lock while it deletes, so no training of that run starts meanwhile).

What goes, by `retention` (tasks/config/schema.py `RetentionConfig`):
- right after a publish (`prune_published`): the run's other checkpoints, locally and in the mirror at
  `train.checkpoint_url`, and publish's own export copies (the version is in the store now). The checkpoint
  the version came from stays, and so does the one `latest` names (a re-run of the same key reuses it).
- `retrainer gc`: whole run directories, with their mirror prefix, that hold no checkpoint a kept version
  came from (`keep_versions` per alias), are not among the `keep_runs` newest and were not active within
  `keep_days`; the same pruning for runs whose version went live (what a publish-time prune missed); store
  objects no version references (stale staging areas, aborted exports, orphaned trees and files) once older
  than `grace_hours`, so an export or publish in flight is never hit; evaluation-cache entries of versions
  the registry does not have.

Deletions are whole: a local directory is renamed aside before it is removed, a mirror prefix loses its
`latest` first, a mirrored checkpoint its marker first, a tree its manifest first (ArtifactStore.remove).
A crash leaves nothing that looks complete, and the next gc finishes the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from tasks.base.errors import LockHeldError, RetrainerError
from tasks.base.fsutil import dir_bytes, modified_at
from tasks.base.lock import default_holder, experiment_lock
from tasks.config.duration import format_duration
from tasks.config.endpoints import registry_for
from tasks.config.evaluation import ExportDtype
from tasks.config.release import RetentionConfig
from tasks.config.schema import JobConfig
from tasks.runs.identity import EXPORT_DIR, RUN_MARKER, RunIdentity

if TYPE_CHECKING:
    from tasks.registry import Registry, VersionRecord
    from tasks.registry.store import ArtifactStore, StoredObject
    from tasks.train.mirror import Mirror

log = logging.getLogger(__name__)

_RUN_ID = re.compile(r"^[0-9a-f]{16}$")
ASIDE = ".gc-"  # a local directory being deleted: renamed to .gc-<name>-<hex> first
DAY = 86400.0


@dataclass(frozen=True)
class Item:
    """One thing housekeeping deletes (or would, or keeps, or skips): what, where, how many bytes, why."""

    kind: str  # run_dir, run_mirror, checkpoint, checkpoint_mirror, export, file, tree, staging, eval_cache
    url: str
    bytes: int
    reason: str
    delete: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    name: str | None = field(default=None, compare=False)  # a store object's name (files, trees: the digest)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.url, "bytes": self.bytes, "reason": self.reason}


@dataclass(frozen=True)
class Pruned:
    """What the housekeeping after a publish deleted (`prune_published`), or why it deleted nothing (`error`: it
    failed, the publish stands, `retrainer gc` reclaims the rest)."""

    items: tuple[Item, ...] = ()
    error: str | None = None

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    def to_xcom(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pruned": [i.to_dict() for i in self.items], "bytes": self.bytes}
        return out if self.error is None else {**out, "error": self.error}


@dataclass
class Report:
    """What a gc deleted (or, dry, would delete), skipped (a held lock) and kept on purpose."""

    dry_run: bool
    delete: list[Item] = field(default_factory=list)
    skipped: list[Item] = field(default_factory=list)
    kept: list[Item] = field(default_factory=list)
    failed: list[Item] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        lists = ("delete", "skipped", "kept", "failed")
        return {"dry_run": self.dry_run, "bytes": sum(i.bytes for i in self.delete),
                **{name: [i.to_dict() for i in getattr(self, name)] for name in lists}}


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def discard_local(path: Path) -> None:
    """Remove a local directory whole: renamed aside first (one step), so no reader finds it half-deleted."""
    aside = path.with_name(f"{ASIDE}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside)


def _rm_url(fs: Any, path: str, first: str | None = None) -> None:
    """Remove an object or a prefix whole through fsspec, `first` (a marker, `latest`) before the rest."""
    if first is not None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{path}/{first}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def _local_run_modified(run_dir: Path) -> float:
    """When a run last wrote anything near its top (status every step, checkpoints, evaluations, summary)."""
    newest = run_dir.stat().st_mtime
    for sub in [run_dir, *(p for p in run_dir.iterdir() if p.is_dir() and not p.is_symlink())]:
        try:
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


# -- pruning a run's checkpoints ------------------------------------------------------------------------------
def mirror_for(cfg: JobConfig, run_id: str) -> Mirror | None:
    if not cfg.train.checkpoint_url:
        return None
    from tasks.train.mirror import Mirror

    return Mirror(cfg.train.checkpoint_url, cfg.train.checkpoint_storage_options, run_id)


def prune_items(run_dir: Path | None, mirror: Mirror | None, keep: set[str], reason: str) -> list[Item]:
    """A run's checkpoints other than `keep` and the one `latest` names (locally and in the mirror; crashed
    commits too), and publish's own export copies."""
    from tasks.stages.publish import export_dir
    from tasks.train.checkpoint import MARKER, ckpt_root, is_tag, read_latest

    items = []
    if run_dir is not None and (root := ckpt_root(run_dir)).is_dir():
        spared = keep | {read_latest(root)}
        for path in sorted(root.iterdir()):
            if path.is_dir() and (is_tag(path.name) or path.name.startswith("tmp-")) and path.name not in spared:
                items.append(Item("checkpoint", str(path), dir_bytes(path), reason, lambda p=path: discard_local(p)))
        exports = run_dir / EXPORT_DIR
        for path in sorted(exports.iterdir()) if exports.is_dir() else []:
            tag, _, dtype = path.name.rpartition("-")
            if dtype in get_args(ExportDtype) and path == export_dir(root / tag, dtype) and path.is_dir():
                items.append(Item("export", str(path), dir_bytes(path), "publish's own export copy (the version's "
                                  "artifact is in the store)", lambda p=path: discard_local(p)))
    if mirror is not None:
        spared = keep | {mirror.latest()}
        try:
            found = mirror.fs.find(mirror.root, detail=True)
        except FileNotFoundError:
            found = {}
        tags: dict[str, int] = {}
        for path, info in found.items():
            parts = path[len(mirror.root) + 1:].split("/")
            if len(parts) > 1 and is_tag(parts[0]):
                tags[parts[0]] = tags.get(parts[0], 0) + info["size"]
        for tag in sorted(set(tags) - spared):
            path = f"{mirror.root}/{tag}"
            items.append(Item("checkpoint_mirror", f"{mirror.url}/{tag}", tags[tag], reason,
                              lambda p=path: _rm_url(mirror.fs, p, MARKER)))
    return items


def prune_published(cfg: JobConfig, run: RunIdentity, tag: str | None, version: str) -> list[Item]:
    """After the alias points at `version`, delete the run's checkpoints but the one it came from (`tag`; None:
    it came from another run's identical weights) and `latest`, under the run's experiment lock; a run holding
    the lock (a training of the same key) is left alone, to `retrainer gc`."""
    run_dir = run.run_dir(cfg)
    reason = f"an intermediate checkpoint ({version} came from {tag or 'another run'})"
    try:
        with experiment_lock(cfg.publish.registry_url, run.experiment_key, default_holder("housekeeping")):
            items = prune_items(run_dir if run_dir.is_dir() else None, mirror_for(cfg, run.run_id),
                                {tag} if tag else set(), reason)
            for item in items:
                _delete(item)
    except LockHeldError as exc:
        log.warning("housekeeping: run %s not pruned: %s", run.run_id, exc)
        return []
    log.info("housekeeping: run %s pruned to %s: %d deleted, %s", run.run_id, tag, len(items),
             _size(sum(i.bytes for i in items)))
    return items


def _delete(item: Item) -> None:
    assert item.delete is not None
    item.delete()
    log.info("gc: deleted %s %s (%s): %s", item.kind, item.url, _size(item.bytes), item.reason)


# -- what the registry keeps --------------------------------------------------------------------------------
@dataclass
class RegistryView:
    """Every version, and why some keep their run's checkpoint (per alias, the ones it pointed to last)."""

    versions: list[VersionRecord]
    kept: dict[tuple[str, int], str]
    went_live: set[tuple[str, int]]

    @classmethod
    def read(cls, registry: Registry, keep_versions: int) -> RegistryView:
        versions: list[VersionRecord] = []
        kept: dict[tuple[str, int], str] = {}
        went_live: set[tuple[str, int]] = set()
        for model in (m["model"] for m in registry.models()):
            versions += registry.list_versions(model)
            pointed: dict[str, list[int]] = {}
            for rec in registry.history(model):  # per alias, oldest first
                pointed.setdefault(rec.alias, []).append(rec.to_version)
            for alias, seq in pointed.items():
                went_live.update((model, v) for v in seq)
                for i, v in enumerate(list(dict.fromkeys(reversed(seq)))[:keep_versions]):
                    kept.setdefault((model, v), f"live on {alias}" if i == 0 else f"on {alias} before")
        return cls(versions, kept, went_live)

    def of_run(self, run_id: str) -> list[VersionRecord]:
        return [v for v in self.versions if v.config_hash[:16] == run_id]

    def digests(self) -> set[str]:
        return {v.artifact_digest for v in self.versions}


# -- the runs -----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run id: its local directory and/or its mirror prefix."""

    run_id: str
    key: str | None = None
    local: Path | None = None
    mirror: Mirror | None = None
    mirror_bytes: int = 0
    modified: float | None = None


def _run_key(run_dir: Path) -> str | None:
    try:
        key = json.loads((run_dir / RUN_MARKER).read_text()).get("experiment_key")
    except (OSError, ValueError, AttributeError):
        return None
    return key if isinstance(key, str) and key[:16] == run_dir.name else None


def _mirror_key(mirror: Mirror) -> str | None:
    from tasks.train.checkpoint import MARKER

    tag = mirror.latest()
    if tag is None:
        return None
    with contextlib.suppress(FileNotFoundError, ValueError, AttributeError):
        key = json.loads(mirror.fs.cat_file(f"{mirror.root}/{tag}/{MARKER}")).get("experiment_key")
        return key if isinstance(key, str) else None
    return None


def list_runs(cfg: JobConfig, report: Report) -> tuple[list[Run], list[Item]]:
    """The run directories under `train.output_dir` and the run prefixes under `train.checkpoint_url`, newest
    first, and the leftovers of interrupted deletions; a folder that is not a run is noted in the report."""
    runs: dict[str, Run] = {}
    leftovers = []
    out = Path(cfg.train.output_dir)
    for path in sorted(out.iterdir()) if out.is_dir() else []:
        if not path.is_dir() or path.is_symlink():
            continue
        if path.name.startswith(ASIDE):
            leftovers.append(Item("run_dir", str(path), dir_bytes(path), "left by an interrupted deletion",
                                  lambda p=path: shutil.rmtree(p)))
        elif (key := _run_key(path)) is None:
            report.skipped.append(Item("run_dir", str(path), 0, f"not a run directory (no {RUN_MARKER} of run "
                                       f"{path.name}): left alone"))
        else:
            runs[path.name] = Run(path.name, key, local=path, modified=_local_run_modified(path))
    if cfg.train.checkpoint_url:
        import fsspec

        fs, root = fsspec.core.url_to_fs(cfg.train.checkpoint_url, **cfg.train.checkpoint_storage_options)
        fs.invalidate_cache(root)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        except FileNotFoundError:
            names = []
        for run_id in filter(_RUN_ID.match, names):
            mirror = mirror_for(cfg, run_id)
            assert mirror is not None
            found = list(mirror.fs.find(mirror.root, detail=True).values())
            if not found:
                continue
            times = [modified_at(info) for info in found]
            newest = None if None in times else max(t for t in times if t is not None)
            run = runs.setdefault(run_id, Run(run_id, key=_mirror_key(mirror), modified=newest))
            run.mirror, run.mirror_bytes = mirror, sum(info["size"] for info in found)
            if run.local is not None:  # unknown stays unknown: such a run is kept
                run.modified = None if newest is None or run.modified is None else max(run.modified, newest)
    newest_first = sorted(runs.values(), key=lambda r: -(r.modified if r.modified is not None else float("inf")))
    return newest_first, leftovers


def _run_items(run: Run, reason: str) -> list[Item]:
    """A whole run: its mirror prefix (`latest` first) and its local directory."""
    from tasks.train.checkpoint import LATEST

    items = []
    if run.mirror is not None:
        m = run.mirror
        items.append(Item("run_mirror", m.url, run.mirror_bytes, reason, lambda: _rm_url(m.fs, m.root, LATEST)))
    if run.local is not None:
        path = run.local
        items.append(Item("run_dir", str(path), dir_bytes(path), reason, lambda: discard_local(path)))
    return items


def _why_kept(run: Run, rank: int, versions: list[VersionRecord], view: RegistryView, policy: RetentionConfig,
              now: float) -> str | None:
    for v in versions:
        if (why := view.kept.get((v.model, v.version))) is not None:
            return f"holds the checkpoint of {v.model} v{v.version} ({why}; retention.keep_versions " \
                   f"{policy.keep_versions})"
    if rank < policy.keep_runs:
        return f"one of the {policy.keep_runs} newest runs (retention.keep_runs)"
    if run.modified is None:
        return "its age is unknown (the filesystem gives no times)"
    age = now - run.modified
    if age < policy.keep_days * DAY:
        return f"active {format_duration(age)} ago (retention.keep_days {policy.keep_days:g})"
    if age < policy.grace_hours * 3600:
        return f"active {format_duration(age)} ago (retention.grace_hours {policy.grace_hours:g})"
    return None


def _staging_in_use(run_dir: Path) -> set[str]:
    """Names of the staging areas a run's export wrote into (its summary and its shard reports say)."""
    docs = []
    with contextlib.suppress(OSError, ValueError):
        docs += (json.loads((run_dir / "summary.json").read_text()).get("export") or {}).get("shards") or []
    for report in (run_dir / EXPORT_DIR).glob("*/*.json"):
        with contextlib.suppress(OSError, ValueError):
            docs.append(json.loads(report.read_text()))
    return {str(d["staging"]).rstrip("/").rsplit("/", 1)[-1] for d in docs if isinstance(d, dict) and d.get("staging")}


# -- the plan -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _held(cfg: JobConfig, key: str | None) -> Iterator[None]:
    """The run's experiment lock (LockHeldError at once if someone holds it); nothing to take without a key."""
    if key is None:
        yield
        return
    with experiment_lock(cfg.publish.registry_url, key, default_holder("retrainer gc")):
        yield


@dataclass
class Group:
    """Items deleted together: a run's, under its experiment lock (`key`), or the store's (`store`: each object
    checked against the registry once more just before)."""

    items: list[Item]
    key: str | None = None
    store: bool = False


def plan(cfg: JobConfig, *, dry_run: bool) -> tuple[Report, list[Group]]:
    """What gc deletes, run by run and then in the store; what it keeps on purpose goes into the report."""
    from tasks.evaluate.cache import entries
    from tasks.registry import ArtifactStore

    policy = cfg.retention
    now = time.time()
    report = Report(dry_run=dry_run)
    store = ArtifactStore(cfg.publish.store_url, cfg.publish.storage_options)
    objects = store.contents()  # listed before the registry is read: a tree committed after is not in it
    cache_fs, cache = entries(cfg)
    view = RegistryView.read(registry_for(cfg), policy.keep_versions)
    runs, leftovers = list_runs(cfg, report)
    groups = [Group(leftovers)]
    in_use: dict[str, str] = {}
    for rank, run in enumerate(runs):
        versions = view.of_run(run.run_id)
        why = _why_kept(run, rank, versions, view, policy, now)
        if why is None:
            names = ", ".join(f"{v.model} v{v.version}" for v in versions)
            age = "" if run.modified is None else f", last active {format_duration(now - run.modified)} ago"
            reason = (f"its versions ({names}) are not among the {policy.keep_versions} an alias pointed to last "
                      "(retention.keep_versions; their artifacts stay)" if versions else "no version came from it")
            groups.append(Group(_run_items(run, reason + age), key=run.key))
            continue
        report.kept += [Item(i.kind, i.url, i.bytes, why) for i in _run_items(run, why)]
        if run.local is not None:
            in_use.update(dict.fromkeys(_staging_in_use(run.local), run.run_id))
        live = [v for v in versions if (v.model, v.version) in view.went_live]
        if live and policy.prune_checkpoints:
            reason = f"an intermediate checkpoint of a run whose version {live[-1].model} v{live[-1].version} went live"
            groups.append(Group(prune_items(run.local, run.mirror, {v.checkpoint_tag for v in versions}, reason),
                                key=run.key))
    groups.append(Group(_store_items(store, objects, view, in_use, policy, now, report), store=True))
    known = {(v.model, v.version) for v in view.versions}
    groups.append(Group([
        Item("eval_cache", cache_fs.unstrip_protocol(e.path), e.size,
             f"evaluation numbers of {e.model} v{e.version}, a version the registry does not have",
             lambda p=e.path: _rm_url(cache_fs, p))
        for e in cache if (e.model, e.version) not in known and e.modified is not None
        and now - e.modified >= policy.grace_hours * 3600]))
    return report, groups


def _store_items(store: ArtifactStore, objects: list[StoredObject], view: RegistryView, in_use: dict[str, str],
                 policy: RetentionConfig, now: float, report: Report) -> list[Item]:
    digests = view.digests()
    artifacts = [o for o in objects if o.kind != "staging" and o.committed]
    if artifacts and not any(o.name in digests for o in artifacts):
        raise RetrainerError(f"gc: the store {store.url} holds {len(artifacts)} artifacts and no version in the "
                             "registry (publish.registry_url) references any of them: is it this store's registry? "
                             "Nothing deleted")
    items = []
    for obj in objects:
        url = store.fs.unstrip_protocol(obj.path)
        if obj.kind != "staging" and obj.name in digests:
            continue  # a version's artifact: never deleted
        if obj.kind == "staging" and obj.name in in_use:
            report.kept.append(Item("staging", url, obj.size, f"the export of run {in_use[obj.name]} (kept)"))
            continue
        if obj.modified is None or now - obj.modified < policy.grace_hours * 3600:
            age = "of unknown age" if obj.modified is None else f"{format_duration(now - obj.modified)} old"
            report.kept.append(Item(obj.kind, url, obj.size, f"no version references it, but it is {age} "
                                    f"(retention.grace_hours {policy.grace_hours:g}: maybe in flight)"))
            continue
        what = {"file": "a file no version references",
                "tree": "a tree no version references (an aborted publish)" if obj.committed
                else "a tree without its manifest (an interrupted commit)",
                "staging": "a staging area no version references (a stale or aborted export)"}[obj.kind]
        items.append(Item(obj.kind, url, obj.size, f"{what}, {format_duration(now - obj.modified)} old",
                          lambda o=obj: store.remove(o), name=obj.name))
    return items


def gc(cfg: JobConfig, *, dry_run: bool = False) -> Report:
    """Reclaim by `cfg.retention`: each run's items under its experiment lock (skipped while someone holds it),
    then the store objects no version references (the registry read again just before: a version published
    meanwhile keeps its artifact)."""
    report, groups = plan(cfg, dry_run=dry_run)
    for group in groups:
        if not group.items:
            continue
        items = group.items
        if group.store and not dry_run:
            items = _still_unreferenced(cfg, items)
        try:
            with _held(cfg, group.key):
                for item in items:
                    if not dry_run:
                        try:
                            _delete(item)
                        except OSError as exc:
                            log.error("gc: could not delete %s %s: %s", item.kind, item.url, exc)
                            report.failed.append(Item(item.kind, item.url, item.bytes, f"{item.reason}; {exc}"))
                            continue
                    report.delete.append(item)
        except LockHeldError as exc:
            report.skipped += [Item(i.kind, i.url, i.bytes, f"{i.reason}; skipped: {exc}") for i in items]
            log.warning("gc: skipped %s: %s", ", ".join(i.url for i in items), exc)
    return report


def _still_unreferenced(cfg: JobConfig, items: list[Item]) -> list[Item]:
    """The store items whose object no version names, by the registry as it is now."""
    digests = RegistryView.read(registry_for(cfg), 0).digests()
    for item in items:
        if item.name in digests:
            log.info("gc: %s %s is a version's artifact now (published meanwhile): kept", item.kind, item.url)
    return [i for i in items if i.name not in digests]


def describe(report: Report) -> str:
    """The report as `retrainer gc` prints it: a total, then each item with its bytes and reason."""
    verb = "would delete" if report.dry_run else "deleted"
    total = sum(i.bytes for i in report.delete)
    lines = [f"gc: {verb} {len(report.delete)} items, {_size(total)}"
             + (" (dry run: nothing deleted)" if report.dry_run else "")]
    for label, items in (("delete", report.delete), ("FAILED", report.failed), ("skip", report.skipped),
                         ("keep", report.kept)):
        lines += [f"  {label:6} {i.kind:17} {i.url}  {_size(i.bytes)}  {i.reason}" for i in items]
    return "\n".join(lines)
