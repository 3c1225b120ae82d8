"""Numbers of a published version on a set of suites, kept beside the artifacts so no one scores it twice.

Why in the artifact store: every Airflow worker and every retrain of the model sees it, and a version's
weights never change, so an entry (version, suite hash) is true forever. Written at publish (the
candidate's own numbers: it was scored as exported) and whenever the gate scores the live model.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from tasks.base.fsutil import modified_at
from tasks.config.schema import JobConfig

log = logging.getLogger(__name__)

CACHE_DIR = "eval-cache"
_ENTRY = re.compile(r"^(?P<model>[^/]+)/v(?P<version>[1-9][0-9]*)/[^/]+\.json$")


@dataclass(frozen=True)
class CacheEntry:
    """One stored entry (housekeeping deletes those of versions the registry does not have)."""

    model: str
    version: int
    path: str
    size: int
    modified: float | None


def _root(cfg: JobConfig) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(cfg.publish.store_url, **cfg.publish.storage_options)
    return fs, f"{root.rstrip('/')}/{CACHE_DIR}"


def _path(cfg: JobConfig, version: int, suite_hash: str) -> tuple[Any, str]:
    fs, root = _root(cfg)
    return fs, f"{root}/{cfg.publish.model_name}/v{version}/{suite_hash}.json"


def entries(cfg: JobConfig) -> tuple[Any, list[CacheEntry]]:
    """The store's filesystem and every cache entry of every model in it."""
    fs, root = _root(cfg)
    fs.invalidate_cache(root)
    found = []
    for path, info in fs.find(root, detail=True).items():
        if m := _ENTRY.match(path[len(root) + 1:]):
            found.append(CacheEntry(m["model"], int(m["version"]), path, info["size"], modified_at(info)))
    return fs, found


def read_cached(cfg: JobConfig, version: int, suite_hash: str) -> dict[str, float] | None:
    fs, path = _path(cfg, version, suite_hash)
    try:
        entry = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("evaluation cache: %s is unreadable; scoring again", path)
        return None
    return {k: float(v) for k, v in entry["metrics"].items()}


def write_cached(cfg: JobConfig, version: int, suite_hash: str, metrics: dict[str, float]) -> None:
    fs, path = _path(cfg, version, suite_hash)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    body = {"model": cfg.publish.model_name, "version": version, "suite_hash": suite_hash, "metrics": metrics}
    fs.pipe_file(path, json.dumps(body, sort_keys=True).encode())
