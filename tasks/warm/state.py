"""The record of verified files per dataset, so a re-warm costs a stat per file, not a transfer.

Two files: a compacted state (`<id>.json`, replaced atomically at the end of a warm)
and an append-only journal (`<id>.journal`, one JSON line per file committed during
a warm, fsynced in batches). A SIGKILL can lose the journal's tail, never corrupt
the record: a torn last line is ignored, and a present-but-unrecorded file is
re-hashed locally (no transfer) before it is trusted.
An entry is trusted only while the file's size and mtime_ns still match.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from tasks.fsutil import atomic_write_bytes

log = logging.getLogger("tasks.warm")

Entry = tuple[int, str, int]  # size, sha256, mtime_ns


class VerifiedRecord:
    def __init__(self, state_path: Path, journal_path: Path, manifest_hash: str) -> None:
        self.state_path = state_path
        self.journal_path = journal_path
        self.manifest_hash = manifest_hash
        self.entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._journal = None
        self._last_sync = 0.0
        self._pending = 0
        self.complete = False  # the loaded state was compacted over every key (what the no-op path trusts)

    def load(self) -> VerifiedRecord:
        try:
            data = json.loads(self.state_path.read_bytes())
            if data.get("manifest_hash") == self.manifest_hash:
                self.entries = {k: (int(v[0]), str(v[1]), int(v[2])) for k, v in data["files"].items()}
                self.complete = data.get("complete") is True
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("warm: ignoring unreadable state %s; files will be re-hashed", self.state_path)
        try:
            with open(self.journal_path, "rb") as fh:
                for line in fh:
                    try:
                        k, size, sha, mtime = json.loads(line)
                        self.entries[k] = (int(size), str(sha), int(mtime))
                    except (ValueError, TypeError):
                        break  # torn tail after a crash
        except FileNotFoundError:
            pass
        return self

    def trusted(self, key: str, size: int, sha256: str, path: str | os.PathLike[str]) -> bool:
        """True if the file at `path` is the one recorded as verified with this size and digest."""
        entry = self.entries.get(key)
        if entry is None or entry[0] != size or entry[1] != sha256:
            return False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return st.st_size == size and st.st_mtime_ns == entry[2]

    def add(self, key: str, size: int, sha256: str, mtime_ns: int) -> None:
        line = json.dumps([key, size, sha256, mtime_ns], separators=(",", ":")) + "\n"
        with self._lock:
            self.entries[key] = (size, sha256, mtime_ns)
            if self._journal is None:
                self.journal_path.parent.mkdir(parents=True, exist_ok=True)
                self._journal = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115
            self._journal.write(line)
            self._pending += 1
            now = time.monotonic()
            if self._pending >= 512 or now - self._last_sync > 1.0:
                self._sync()
                self._last_sync = now

    def _sync(self) -> None:
        if self._journal is not None and self._pending:
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._pending = 0

    def close(self) -> None:
        with self._lock:
            self._sync()
            if self._journal is not None:
                self._journal.close()
                self._journal = None

    def compact(self, keys: set[str]) -> None:
        """Replace state with the entries for `keys` (atomically), then drop the journal.

        `complete` says the record covers every key of the manifest: what `complete_entries` trusts.
        """
        self.close()
        files = {k: list(v) for k, v in self.entries.items() if k in keys}
        state = {"manifest_hash": self.manifest_hash, "complete": len(files) == len(keys), "files": files}
        atomic_write_bytes(self.state_path, json.dumps(state, separators=(",", ":")).encode())  # C encoder
        self.journal_path.unlink(missing_ok=True)


def complete_entries(state_path: Path, journal_path: Path, manifest_hash: str) -> dict[str, list[Any]] | None:
    """{key: [size, sha256, mtime_ns]} of a compacted record covering every file of this manifest, else None.

    A journal means a warm since then did not finish (crash, failure): then nothing is trusted here.
    """
    if journal_path.exists():
        return None
    try:
        data = json.loads(state_path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("manifest_hash") != manifest_hash or data.get("complete") is not True:
        return None
    files = data.get("files")
    return files if isinstance(files, dict) else None
