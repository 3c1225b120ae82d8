"""Checkpoints on node-local disks, mirrored to object storage, so a retry on other nodes resumes.

Why: a run directory on each node's own SSD is fast but dies with the node. With `train.checkpoint_url`
every committed checkpoint is also uploaded to `<checkpoint_url>/<run id>/<tag>/`: after the local
commit, each node's first rank uploads the files its node holds (a file several nodes see, on a shared
run directory, is uploaded once, by the first of them), then rank 0 uploads the `COMPLETE` marker and
then `latest`: a tag whose marker is not in the mirror is not there, whatever else was uploaded. At
start, a node whose disk lacks the checkpoint the run resumes from takes that tag's marker, then its
ranks download only the files they load (tasks/train/reshard.py: rank_files): every rank resumes from
the same step, bit for bit, and a replaced node fetches its own ranks' share, not the whole checkpoint.
Credentials for the mirror reach the ranks as environment variables (tasks/base/credentials.py), never in a
file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import fsspec

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import fsync_dir, fsync_tree
from tasks.train.commit import LATEST, MARKER, commit

log = logging.getLogger(__name__)


class Mirror:
    """One run's checkpoints under `<url>/<run_id>/`."""

    def __init__(self, url: str, storage_options: dict[str, Any], run_id: str) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = f"{root.rstrip('/')}/{run_id}"
        self.url = self.fs.unstrip_protocol(self.root)

    def _tag(self, tag: str) -> str:
        return f"{self.root}/{tag}"

    def upload(self, local_dir: Path, tag: str, names: list[str]) -> None:
        """Upload these files of a committed checkpoint (never the marker: `commit` puts it last)."""
        if names:
            self.fs.makedirs(self._tag(tag), exist_ok=True)  # a no-op on object stores
            self.fs.put([str(local_dir / n) for n in names], [f"{self._tag(tag)}/{n}" for n in names])

    def commit(self, local_dir: Path, tag: str, keep_last: int) -> None:
        """Rank 0, once every node uploaded its files: the marker, then `latest`, then prune old tags."""
        self.fs.makedirs(self._tag(tag), exist_ok=True)
        self.fs.put_file(str(local_dir / MARKER), f"{self._tag(tag)}/{MARKER}")
        self.fs.pipe_file(f"{self.root}/{LATEST}", (tag + "\n").encode())
        self.prune(keep_last, keep=tag)
        log.info("checkpoint %s mirrored to %s", tag, self.url)

    def latest(self) -> str | None:
        """The newest mirrored tag whose marker is there, or None."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self.root)
        try:
            tag = self.fs.cat_file(f"{self.root}/{LATEST}").decode().strip()
        except FileNotFoundError:
            return None
        return tag if self.fs.exists(f"{self._tag(tag)}/{MARKER}") else None

    def marker(self, tag: str) -> dict[str, Any]:
        """The mirrored tag's `COMPLETE` marker (what was trained, to which step, with which layout)."""
        try:
            return json.loads(self.fs.cat_file(f"{self._tag(tag)}/{MARKER}"))
        except FileNotFoundError:
            raise InvalidInputError(f"{self.url}/{tag}: not a complete mirrored checkpoint (no {MARKER})") from None

    def fetch_marker(self, tag: str, root: Path) -> Path:
        """Make this node's `root/<tag>` a committed checkpoint dir of the mirrored tag (through `root/tmp-<tag>`,
        marker only) and point `latest` at it; its files come later, each rank's own (`fetch_files`)."""
        final, tmp = root / tag, root / f"tmp-{tag}"
        if (final / MARKER).is_file():
            return final
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.fs.get_file(f"{self._tag(tag)}/{MARKER}", str(tmp / MARKER))
        commit(root, tag)
        return final

    def names(self, tag: str) -> list[str]:
        """The file names the mirrored tag holds."""
        return [p.rsplit("/", 1)[-1] for p in self.fs.find(self._tag(tag))]

    def fetch_files(self, tag: str, final: Path, names: list[str]) -> int:
        """Download those of `names` that `final` (this node's copy of the tag) lacks; how many it downloaded.
        Each file lands whole (a partial one never carries its final name)."""
        missing = [n for n in names if not (final / n).exists()]
        for name in missing:
            part = final / f".{name}.part"
            self.fs.get_file(f"{self._tag(tag)}/{name}", str(part))
            part.rename(final / name)
        if missing:
            fsync_tree(final)
            log.info("checkpoint %s: fetched %d files from the mirror %s", tag, len(missing), self.url)
        return len(missing)

    def weights(self, tag: str, local: Path, dest: Path) -> Path:
        """A directory holding the tag's model-weight files (`layer_*`, never optimizer states) and marker:
        `local` when this node already has them all, else a copy fetched into `dest/<tag>` (marker last)."""
        names = [p.rsplit("/", 1)[-1] for p in self.fs.find(self._tag(tag))]
        if MARKER not in names:
            raise InvalidInputError(f"{self.url}/{tag}: not a complete mirrored checkpoint (no {MARKER})")
        wanted = [n for n in names if n.startswith("layer_")]
        if (local / MARKER).is_file() and all((local / n).is_file() for n in wanted):
            return local
        final, tmp = dest / tag, dest / f"tmp-{tag}"
        if (final / MARKER).is_file():
            return final
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.fs.get([f"{self._tag(tag)}/{n}" for n in wanted], [str(tmp / n) for n in wanted])
        self.fs.get_file(f"{self._tag(tag)}/{MARKER}", str(tmp / MARKER))
        fsync_tree(tmp)
        tmp.rename(final)
        fsync_dir(dest)
        log.info("checkpoint %s: %d weight files fetched from the mirror %s", tag, len(wanted), self.url)
        return final

    def prune(self, keep_last: int, keep: str) -> None:
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return
        tags = sorted((p.rsplit("/", 1)[-1] for p in found if p.rsplit("/", 1)[-1].startswith("step-")),
                      key=lambda t: int(t.split("-")[1]))
        for tag in tags[:-keep_last]:
            if tag != keep:
                self.fs.rm(self._tag(tag), recursive=True)


def assign_uploads(listings: list[list[str]]) -> list[list[str]]:
    """Per rank, the files it uploads: each name by the first rank whose listing holds it."""
    seen: set[str] = set()
    out = []
    for names in listings:
        mine = [n for n in names if n not in seen and n != MARKER]
        seen.update(mine)
        out.append(mine)
    return out
