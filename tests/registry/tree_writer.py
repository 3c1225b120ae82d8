"""A writer process for the tree tests: puts one file into a staging area, as a training rank would."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def payload(index: int) -> bytes:
    """Distinct, several-chunk contents per writer (sizes differ, so a mix-up shows)."""
    return hashlib.sha256(f"shard {index}".encode()).digest() * (40_000 + 1000 * index)


def write(store_url: str, options: dict[str, Any], staging: str, path: str, index: int, tmp: str) -> dict[str, Any]:
    """Even writers use `ArtifactStore.stage_file`; odd ones plain fsspec with their own hashing.

    Either way the writer reports (path, size, sha256) of what it wrote; the committer never re-reads it."""
    data = payload(index)
    if index % 2 == 0:
        from tasks.registry import ArtifactStore

        local = Path(tmp) / f"part-{index}-{os.getpid()}"
        local.write_bytes(data)
        return ArtifactStore(store_url, options).stage_file(staging, path, local).to_dict()
    import fsspec

    with fsspec.open(f"{staging}/{path}", "wb", **options) as fh:
        fh.write(data)
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
