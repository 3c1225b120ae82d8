"""The tree manifest: what a directory artifact (a Hugging Face model folder) holds, as canonical bytes.

`{"format": "retrainer-tree/1", "files": [{"path", "sha256", "size"}, ...]}`, files sorted by
path, keys sorted, no whitespace, ASCII: one tree has exactly one byte string, and its digest
(the version's `artifact_digest`) is the sha256 of those bytes. Paths follow the dataset key
rules (`tasks.base.dataset_format.validate_key`: relative, no `..`, no empty segment), appear once,
and none is both a file and a folder. The manifest is stored in the tree as `manifest.json`,
which the key rules reserve, so it can never collide with a listed file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import cached_property
from itertools import pairwise
from typing import Any

from tasks.base.dataset_format import MANIFEST_KEY, validate_key
from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import sha256_bytes
from tasks.registry.names import check_digest

FORMAT = "retrainer-tree/1"
MANIFEST_NAME = MANIFEST_KEY  # the commit marker: a tree without it is not committed


def check_path(path: object, field: str = "path") -> str:
    """A file's path inside a tree, or InvalidInputError naming `field` and the path."""
    if not isinstance(path, str):
        raise InvalidInputError(f"{field}: must be a string, got {type(path).__name__}")
    try:
        return validate_key(path)
    except ValueError as exc:
        raise InvalidInputError(f"{field}: {exc}") from None


@dataclass(frozen=True)
class TreeFile:
    """One file of a tree: where, how many bytes, and what they hash to (computed by whoever wrote them)."""

    path: str
    size: int
    sha256: str

    @classmethod
    def from_dict(cls, obj: Any, field: str = "file") -> TreeFile:
        if not isinstance(obj, dict) or set(obj) != {"path", "size", "sha256"}:
            raise InvalidInputError(f"{field}: must be an object with exactly path, size, sha256")
        return cls(path=obj["path"], size=obj["size"], sha256=obj["sha256"]).checked(field)

    def checked(self, field: str = "file") -> TreeFile:
        check_path(self.path, f"{field}.path")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise InvalidInputError(f"{field}.size ({self.path}): must be a non-negative integer, got {self.size!r}")
        check_digest(self.sha256, f"{field}.sha256 ({self.path})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TreeManifest:
    """A validated, sorted list of files; `to_bytes()` is its canonical form and `digest` the tree's identity."""

    files: tuple[TreeFile, ...]

    @classmethod
    def of(cls, files: Iterable[TreeFile | dict[str, Any]]) -> TreeManifest:
        """Build from the writers' entries (TreeFile or their `to_dict()`), in any order; refuse bad ones."""
        checked = [f.checked(f"files[{i}]") if isinstance(f, TreeFile) else TreeFile.from_dict(f, f"files[{i}]")
                   for i, f in enumerate(files)]
        if not checked:
            raise InvalidInputError("tree manifest: lists no file (a tree holds at least one)")
        checked.sort(key=lambda f: f.path)
        paths = [f.path for f in checked]
        for a, b in pairwise(paths):
            if a == b:
                raise InvalidInputError(f"tree manifest: {a} is listed twice")
        folders = {p[:i] for p in paths for i, ch in enumerate(p) if ch == "/"}
        if clash := sorted(folders.intersection(paths)):
            raise InvalidInputError(f"tree manifest: {clash[0]} is both a file and a folder")
        return cls(files=tuple(checked))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "tree manifest") -> TreeManifest:
        """Parse stored bytes; refuse anything but the canonical form of a valid manifest."""
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidInputError(f"{where}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or set(obj) != {"format", "files"}:
            raise InvalidInputError(f"{where}: not a {FORMAT} manifest")
        if not isinstance(obj["files"], list):
            raise InvalidInputError(f"{where}: files must be a list")
        manifest = cls.of(obj["files"])
        if manifest.to_bytes() != raw:
            raise InvalidInputError(f"{where}: not in canonical form (sorted, compact); its digest would be ambiguous")
        return manifest

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "files": [f.to_dict() for f in self.files]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @cached_property
    def digest(self) -> str:
        return sha256_bytes(self.to_bytes())

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)
