"""Input specs (paths, globs, directories, fsspec URLs) -> the ordered list of files to read.

The order is the order of the specs, each expanded in sorted order: it is the
order of documents in the output. A file's format comes from its name unless
`--format` says; a directory contributes the files whose format it can tell,
skipping hidden ones (`.x`, `_SUCCESS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO

from tasks.base.errors import InvalidInputError

FORMATS = ("jsonl", "parquet", "text")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet",
            ".txt": "text", ".text": "text", ".md": "text"}


@dataclass(frozen=True)
class InputFile:
    name: str  # as the user knows it: a local path or a URL
    fs: Any
    path: str
    kind: str
    size: int

    def open(self) -> BinaryIO:
        try:
            return self.fs.open(self.path, "rb")
        except OSError as exc:
            raise InvalidInputError(f"{self.name}: cannot open: {exc}") from None


def expand(specs: list[str], fmt: str = "auto", storage_options: dict[str, Any] | None = None) -> list[InputFile]:
    import fsspec

    files: dict[str, InputFile] = {}
    for spec in specs:
        fs, path = fsspec.core.url_to_fs(spec, **(storage_options or {}))
        if fsspec.core.has_magic(path):
            found = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") != "directory"}
        elif fs.isdir(path):
            found = {p: i for p, i in fs.find(path, detail=True).items()
                     if not _hidden(p) and (fmt != "auto" or _kind(p))}
        elif fs.isfile(path):
            found = {path: fs.info(path)}
        else:
            raise InvalidInputError(f"{spec}: no such file or directory")
        if not found:
            raise InvalidInputError(f"{spec}: matches no input files")
        local = "://" not in spec
        for p in sorted(found):
            name = p if local else fs.unstrip_protocol(p)
            kind = fmt if fmt != "auto" else _kind(p)
            if kind is None:
                raise InvalidInputError(f"{name}: cannot tell the format from the name "
                                        f"(suffixes: {', '.join(SUFFIXES)}): pass --format")
            files.setdefault(name, InputFile(name, fs, p, kind, int(found[p].get("size") or 0)))
    return list(files.values())


def _kind(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1].lower()
    return next((kind for suffix, kind in SUFFIXES.items() if name.endswith(suffix)), None)


def _hidden(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith((".", "_"))
