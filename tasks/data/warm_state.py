"""The record of verified files per dataset, so a re-warm costs a stat per file, not a transfer.

Two files: a compacted state (`<id>.json`, replaced atomically at the end of a warm)
and an append-only journal (`<id>.journal`, one JSON line per file committed during
a warm, fsynced in batches). A SIGKILL can lose the journal's tail, never corrupt
the record: a torn last line is ignored, and a present-but-unrecorded file is
re-hashed locally (no transfer) before it is trusted.
An entry is trusted only while the file's size and mtime_ns still match.

Each entry also keeps what the scan of the file's bytes found (tasks/data/tokens.py: its largest token id),
and the compacted state the manifest's dtype and vocab_size and each split's largest id, so that a warm or a
plan for another model checks the cached data without reading it. An entry written before token ids were
recorded is not trusted: that file is re-hashed (and scanned) locally once, never fetched again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.base.fsutil import atomic_write_bytes
from tasks.data.tokens import ShardCheck, ShardRules, Tokens, max_by_split

log = logging.getLogger("tasks.data.warm")

Entry = tuple[int, str, int, int | None, int | None]  # size, sha256, mtime_ns, largest token id, read as wider


def _entry(fields: Any) -> Entry:
    """An entry from its JSON list; ValueError for one of another shape (a torn line, an older format)."""
    if not isinstance(fields, list) or len(fields) != 5:
        raise ValueError("not a record entry")
    size, sha256, mtime, max_id, wider = fields
    return int(size), str(sha256), int(mtime), None if max_id is None else int(max_id), \
        None if wider is None else int(wider)


def tokens_of(entry: Entry) -> Tokens:
    return Tokens(entry[3], entry[4])


class VerifiedRecord:
    def __init__(self, state_path: Path, journal_path: Path, manifest_hash: str, dtype: str, vocab_size: int) -> None:
        self.state_path = state_path
        self.journal_path = journal_path
        self.manifest_hash = manifest_hash
        self.dtype = dtype  # the manifest's, kept in the state for checks that do not parse it
        self.vocab_size = vocab_size
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
                for k, v in data["files"].items():
                    with contextlib.suppress(ValueError, TypeError):  # an older entry: re-hashed
                        self.entries[k] = _entry(v)
                self.complete = data.get("complete") is True
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("warm: ignoring unreadable state %s; files will be re-hashed", self.state_path)
        try:
            with open(self.journal_path, "rb") as fh:
                for line in fh:
                    try:
                        k, *fields = json.loads(line)
                        self.entries[k] = _entry(fields)
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

    def add(self, key: str, size: int, sha256: str, mtime_ns: int, tokens: Tokens) -> None:
        entry = (size, sha256, mtime_ns, tokens.max_id, tokens.wider_max)
        line = json.dumps([key, *entry], separators=(",", ":")) + "\n"
        with self._lock:
            self.entries[key] = entry
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
        by_split = max_by_split({k: tokens_of(v) for k, v in self.entries.items() if k in keys})
        state = {"manifest_hash": self.manifest_hash, "complete": len(files) == len(keys), "dtype": self.dtype,
                 "vocab_size": self.vocab_size, "max_token_id": max(by_split.values(), default=None),
                 "max_token_id_by_split": by_split, "files": files}
        atomic_write_bytes(self.state_path, json.dumps(state, separators=(",", ":")).encode())  # C encoder
        self.journal_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class CompleteRecord:
    """A compacted record covering every file of a manifest: what a no-op re-warm and a plan trust."""

    dtype: str
    vocab_size: int
    files: dict[str, Entry]

    def refuse_unreadable(self, rules: ShardRules, where: str) -> None:
        """The cached dataset checked against the model that reads it from the record alone, nothing read: the
        splits it reads, then each file's recorded token ids."""
        check = ShardCheck(rules, where, self.dtype, self.vocab_size)
        check.refuse_manifest({key: entry[0] for key, entry in self.files.items()})
        for key, entry in sorted(self.files.items()):
            check.accept(key, tokens_of(entry))


def complete_record(state_path: Path, journal_path: Path, manifest_hash: str) -> CompleteRecord | None:
    """The record of a complete warm of this manifest, else None (never warmed, unfinished, or written before
    token ids were recorded). A journal means a warm since then did not finish (crash, failure): then nothing
    is trusted here."""
    if journal_path.exists():
        return None
    try:
        data = json.loads(state_path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("manifest_hash") != manifest_hash or data.get("complete") is not True:
        return None
    try:
        return CompleteRecord(str(data["dtype"]), int(data["vocab_size"]),
                              {str(k): _entry(v) for k, v in data["files"].items()})
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
