"""Committing a checkpoint tag on this node's disk: the complete `root/tmp-<tag>` becomes `root/<tag>` and
`latest` names it.

Why its own module: a training rank 0 commits what the ranks wrote (tasks/train/checkpoint.py: finalize) and a
node commits the marker it took from the mirror (tasks/train/mirror.py: fetch_marker); the checkpoint module
uses the mirror, so the one commit sequence and the names sit below both.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.base.fsutil import atomic_write_bytes, fsync_dir, fsync_tree

MARKER = "COMPLETE"  # a checkpoint dir without it is not committed
LATEST = "latest"  # the checkpoint root's pointer to its newest committed tag


def commit(root: Path, tag: str) -> Path:
    """Make the complete `root/tmp-<tag>` (its marker included) the checkpoint `root/<tag>` and point `latest` at
    it: fsync, rename, fsync the root, pointer. A training rank 0 commits what the ranks wrote, a node what it
    fetched from the mirror."""
    tmp, final = root / f"tmp-{tag}", root / tag
    fsync_tree(tmp)
    if final.exists():  # a committed dir of the same tag can only come from a rerun past it
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    atomic_write_bytes(root / LATEST, (tag + "\n").encode())
    return final
