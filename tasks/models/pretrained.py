"""Bring a Hugging Face model directory in: its sizes into the config, its files onto the local SSD.

Why the sizes come from config.json: a YAML that repeats them can only be right or contradict the
model; a contradiction is an error naming the field and both values (never a silent override).
Why the identity is the source listing: the run's experiment key needs the starting weights' identity
when the run is planned, before anything is downloaded; names, sizes and ETags (or mtimes) change
whenever the files do. The warm then downloads each file once into
`<cache_dir>/models/<listing digest>/`, hashing it on the way; a file whose size or mtime changed
locally is fetched again (incremental), and where the source is a retrainer tree (its `tree.json`
lists sha256s) every file is checked against it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import fsspec
from filelock import FileLock

from tasks.base.dataset_format import relative_key
from tasks.base.errors import ConfigError, InvalidInputError
from tasks.base.fastcopy import copy_local, copy_stream
from tasks.base.fsutil import atomic_write_json, atomic_writer, fsync_dir, is_local_fs, leads_outside
from tasks.base.model_files import HF_INDEX, index_shards
from tasks.config.model import ModelConfig
from tasks.config.util import sha256_json
from tasks.models import family_for_architecture

log = logging.getLogger(__name__)

CONFIG = "config.json"
VERIFIED = ".retrainer-verified.json"
PARTIAL = ".partial"  # a folder on its way into the cache, not yet checked whole
_PARALLEL_FILES = 8


def _fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return fs, root.rstrip("/")


def read_hf_config(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    fs, root = _fs(url, storage_options)
    try:
        return json.loads(fs.cat_file(f"{root}/{CONFIG}"))
    except FileNotFoundError:
        raise InvalidInputError(f"model.pretrained: {url} has no {CONFIG}") from None
    except ValueError as exc:
        raise InvalidInputError(f"model.pretrained: {url}/{CONFIG} is not JSON: {exc}") from None


def sizes_from_pretrained(m: ModelConfig, source: str) -> dict[str, Any]:
    """The model section with its sizes from the pretrained config.json; a contradicting YAML value is an error.

    model.seq_len is the training context: it may be shorter than the model's max_position_embeddings
    (default: that maximum) but not longer."""
    url = m.pretrained
    assert url is not None
    try:
        listing(url, m.pretrained_storage_options)  # every file inside the folder, before one is read
        config = read_hf_config(url, m.pretrained_storage_options)
        family = family_for_architecture(config.get("architectures"))
        if "family" in m.model_fields_set and m.family != family.name:
            raise InvalidInputError(f"model.family {m.family!r} contradicts config.json architectures "
                                    f"{config.get('architectures')!r} (model.family {family.name!r}); "
                                    "leave model.family out (the pretrained model decides it)")
        fields = family.model_fields_from_hf(config)
    except InvalidInputError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    current = m.model_dump(mode="json")
    max_len = fields.pop("seq_len")
    if "seq_len" in m.model_fields_set:
        if m.seq_len > max_len:
            raise ConfigError(f"{source}: model.seq_len ({m.seq_len}) exceeds {url}/{CONFIG} "
                              f"max_position_embeddings ({max_len})")
    else:
        current["seq_len"] = max_len
    for field, value in fields.items():
        if field in m.model_fields_set and current[field] != value:
            raise ConfigError(f"{source}: model.{field} is {current[field]!r} here but {value!r} in "
                              f"{url}/{CONFIG}; leave it out (the pretrained model decides it)")
        current[field] = value
    return current


def listing(url: str, storage_options: dict[str, Any]) -> list[dict[str, Any]]:
    """(path, size, tag) of every file of the directory; tag = the store's ETag, else its mtime.

    Every path stays inside the folder: a key with `..`, a symlink whose target leaves it and an index entry
    naming anything but one of its files are refused, naming the file (what is listed is what the warm
    copies, the ranks read and publish passes on). A symlink to a file inside the folder is followed."""
    fs, root = _fs(url, storage_options)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    local, out = is_local_fs(fs), []
    for name, info in sorted(found.items()):
        rel = name[len(root) + 1:]
        try:
            relative_key(rel)
        except ValueError as exc:
            raise InvalidInputError(f"model.pretrained: {url}: {exc}; refused") from None
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        if local and info.get("islink"):
            info = _link_target(root, rel, url)
        if info.get("type") != "file":
            continue
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        out.append({"path": rel, "size": int(info["size"]), "tag": str(tag)})
    paths = {e["path"] for e in out}
    if CONFIG not in paths:
        raise InvalidInputError(f"model.pretrained: {url} has no {CONFIG}")
    if HF_INDEX in paths:
        for shard in index_shards(fs.cat_file(f"{root}/{HF_INDEX}"), f"model.pretrained: {url}/{HF_INDEX}"):
            if shard not in paths:
                raise InvalidInputError(f"model.pretrained: {url}/{HF_INDEX} names {shard!r}, which is not a "
                                        f"file of {url}; refused")
    return out


def _link_target(root: str, rel: str, url: str) -> dict[str, Any]:
    """The listing entry of a symlink in a local folder: its target's, when that is a file inside the folder."""
    away = leads_outside(root, rel)
    if away is not None:
        raise InvalidInputError(
            f"model.pretrained: {url}/{rel} is a symlink to {away}, outside the folder; refused (a model folder's "
            "files lie inside it. A Hugging Face cache snapshot links into ../../blobs: materialise it with "
            "`huggingface-cli download REPO --local-dir DIR` or `cp -rL SNAPSHOT DIR`)")
    target = Path(root, rel).resolve()
    if not target.is_file():
        raise InvalidInputError(f"model.pretrained: {url}/{rel} is a symlink to {target}, not a file; refused")
    st = target.stat()
    return {"type": "file", "size": st.st_size, "mtime": st.st_mtime}


def listing_digest(url: str, storage_options: dict[str, Any]) -> str:
    """The pretrained directory's identity as it is now (see the module docstring)."""
    return sha256_json(listing(url, storage_options))


def planned_listing(url: str, storage_options: dict[str, Any], expected_digest: str | None) -> list[dict[str, Any]]:
    """The directory's listing, refused when it changed since the run was planned (`expected_digest`)."""
    entries = listing(url, storage_options)
    digest = sha256_json(entries)
    if expected_digest is not None and digest != expected_digest:
        raise InvalidInputError(f"model.pretrained: {url} changed since this run was planned "
                                f"(listing {expected_digest[:12]} then, {digest[:12]} now); start a new run")
    return entries


def warm_pretrained(url: str, m: ModelConfig, cache_dir: str | Path, expected_digest: str | None = None) -> Path:
    """The directory on local disk, every file fetched once, hashed and checked on the way in
    (tasks/models/intake.py); refuses a source that changed since the run was planned (`expected_digest`).

    The files land in `<entry>.partial/` (kept for a later warm to go on from, should this one fail on the
    way) and the folder takes its name in the cache only once all of it passed; a refused folder leaves
    nothing there. A cached one is not checked again: only a file fetched anew (say its copy was changed)
    is, and the folder's header facts with it."""
    from tasks.models.intake import check_folder  # numpy, torch: only a warm needs them

    storage_options = m.pretrained_storage_options
    entries = planned_listing(url, storage_options, expected_digest)
    dest = model_dir(cache_dir, sha256_json(entries))
    dest.parent.mkdir(parents=True, exist_ok=True)
    fs, root = _fs(url, storage_options)
    expected = _tree_sha256s(fs, root)
    started = time.monotonic()
    with FileLock(str(dest) + ".lock"):
        work = dest if dest.is_dir() else dest.with_name(dest.name + PARTIAL)
        try:
            todo = _fetch_all(fs, root, work, entries, expected, f"model.pretrained {url}")
            if todo:
                check_folder(work, m, f"model.pretrained {url}")
                log.info("model: %s checked: every tensor finite, of the shape and dtype config.json says; "
                         "tokenizer ids below vocab_size %d", url, m.vocab_size)
        except InvalidInputError:
            shutil.rmtree(work, ignore_errors=True)
            raise
        if work != dest:
            work.rename(dest)
            fsync_dir(dest.parent)
    fetched = sum(e["size"] for e in todo)
    seconds = time.monotonic() - started
    log.info("model: %s warm in %s: %d files (%d fetched, %d bytes, %.1f MB/s), %d reused",
             url, dest, len(entries), len(todo), fetched, fetched / max(seconds, 1e-9) / 1e6, len(entries) - len(todo))
    return dest


def model_dir(cache_dir: str | Path, digest: str) -> Path:
    """Where a pretrained directory of this listing digest is warmed under a cache."""
    return Path(cache_dir) / "models" / digest[:32]


def _tree_sha256s(fs: Any, root: str) -> dict[str, str]:
    """sha256 by path when the source is a retrainer tree (a registry version's directory)."""
    from tasks.registry.tree import MANIFEST_NAME, TreeManifest

    try:
        raw = fs.cat_file(f"{root}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return {}
    return {f.path: f.sha256 for f in TreeManifest.from_bytes(raw, f"{root}/{MANIFEST_NAME}").files}


def _fetch_all(fs: Any, root: str, work: Path, entries: list[dict[str, Any]], expected: dict[str, str],
               label: str) -> list[dict[str, Any]]:
    """Fetch into `work` every entry its record does not hold as fetched and checked (a few at once); the ones
    fetched. The first refusal stops the ones not started yet."""
    record_path = work / VERIFIED
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    todo = [e for e in entries if not _still_good(work / e["path"], record.get(e["path"]), e["size"])]
    with ThreadPoolExecutor(_PARALLEL_FILES) as pool:
        futures = {pool.submit(_fetch, fs, root, work, e, expected, label): e["path"] for e in todo}
        try:
            for future in as_completed(futures):
                record[futures[future]] = future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    atomic_write_json(record_path, record)
    return todo


def _still_good(path: Path, rec: dict[str, Any] | None, size: int) -> bool:
    if rec is None or not rec.get("checked") or not path.is_file():
        return False
    st = path.stat()
    return st.st_size == size == rec["size"] and st.st_mtime_ns == rec["mtime_ns"]


def _fetch(fs: Any, root: str, dest: Path, entry: dict[str, Any], expected: dict[str, str],
           label: str) -> dict[str, Any]:
    """One file copied in, hashed and (a safetensors file) its every float checked finite in the same pass."""
    from tasks.models.intake import FiniteCheck  # numpy: only a warm needs it

    target = dest / entry["path"]
    target.parent.mkdir(parents=True, exist_ok=True)
    src = f"{root}/{entry['path']}"
    check = FiniteCheck(f"{label}: {entry['path']}") if entry["path"].endswith(".safetensors") else None
    tap = None if check is None else check.feed
    with atomic_writer(target) as fout:
        if is_local_fs(fs):  # not through fsspec's generic reads (issue 27: 5x slower than cp -r)
            digest, size = copy_local(src, fout, tap)
        else:
            with fs.open(src, "rb") as fin:
                digest, size = copy_stream(fin, fout, tap)
        want = expected.get(entry["path"])
        if size != entry["size"] or (want is not None and digest != want):
            raise InvalidInputError(f"model.pretrained: {entry['path']} fetched as {size} bytes hashing to "
                                    f"{digest[:12]}, the source lists {entry['size']} bytes"
                                    + (f" and sha256 {want[:12]}" if want else "") + "; refused")
        if check is not None:
            check.finish()
    log.info("model: fetched %s (%d bytes%s)", entry["path"], size, ", every float finite" if check else "")
    return {"size": size, "sha256": digest, "mtime_ns": os.stat(target).st_mtime_ns, "checked": True}
