"""Fetching a deploy's version onto the serving host: the registry's verified pull, reused when already complete."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.base.model_files import LEGACY_FILE
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.deploy.target import DeployTarget
from tasks.registry import ArtifactStore

if TYPE_CHECKING:
    from tasks.registry import VersionRecord

log = logging.getLogger(__name__)


def pull(cfg: JobConfig, target: DeployTarget) -> Path:
    """The target's artifact in `target.model_dir`, verified; a complete earlier pull is reused."""

    rec = registry_for(cfg).get_version(target.model, target.version)
    store = ArtifactStore.of_version(rec, cfg.publish.storage_options)
    dest = Path(target.model_dir)
    if dest.is_dir():
        missing = _incomplete(store, rec, dest)
        if not missing:
            log.info("deploy: v%d already pulled into %s (verified then; every file there with its size)",
                     rec.version, dest)
            return dest
        log.warning("deploy: %s is incomplete (%s): pulling v%d again", dest, missing, rec.version)
        shutil.rmtree(dest)
    started = time.monotonic()
    store.pull(rec, dest)
    log.info("deploy: pulled v%d (%d bytes, every file verified) into %s in %.1f s", rec.version, rec.size_bytes,
             dest, time.monotonic() - started)
    return dest


def _incomplete(store: ArtifactStore, rec: VersionRecord, dest: Path) -> str | None:
    """What a local copy lacks against the version's manifest (by size), or None when complete."""

    expected = ({f.path: f.size for f in store.tree_manifest(rec.artifact_digest).files}
                if rec.artifact_kind == "tree" else {LEGACY_FILE: rec.size_bytes})
    for path, size in expected.items():
        local = dest / path
        if not local.is_file() or local.stat().st_size != size:
            return f"{path} missing or not {size} bytes"
    return None
