"""Example deploy hooks (`deploy.entry_point: tasks.deploy.hooks:serving_pointer`); write your own the same way.

A hook is `function(target: DeployTarget) -> None`, called in a process of its own on the serving host after the
smoke test passed; raising (or, for a `deploy.command`, a non-zero exit) fails the deploy and rolls the alias back.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tasks.base.fsutil import atomic_write_json, fsync_dir
from tasks.deploy.target import DeployTarget

log = logging.getLogger(__name__)


def serving_pointer(target: DeployTarget) -> None:
    """Point the serving side at the version: `<models_dir>/<alias>` becomes a symlink to its directory (a server
    started on that path, e.g. `vllm serve <models_dir>/production`, loads it on its next start) and
    `<models_dir>/<alias>.json` says which version it is. Both are replaced atomically (a rename): a reader sees
    the old pointer or the new one, never neither."""
    version_dir = Path(target.model_dir)
    link = version_dir.parent / target.alias
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version_dir.name)  # relative: the directory may be mounted elsewhere on the server
    os.replace(tmp, link)
    fsync_dir(link.parent)
    atomic_write_json(link.with_name(f"{target.alias}.json"),
                      {"model": target.model, "alias": target.alias, "version": target.version,
                       "digest": target.digest, "path": str(version_dir)})
    log.info("serving pointer %s -> %s (v%d)", link, version_dir.name, target.version)
