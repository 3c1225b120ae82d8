"""Durable local-file primitives shared by every stage.

A reader must never see a partial file: write to a temporary name in the same
directory, fsync the file, rename over the final name, fsync the directory.
`put_object` routes a write through fsspec onto these when the filesystem is local.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from tasks.base.errors import InvalidInputError

CHUNK = 1 << 20


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "wb", *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield a file object; on clean exit it is fsynced and renamed onto `path`.

    On error the temporary file is removed and `path` is left as it was. `durable=False` skips
    the fsyncs (still atomic, not crash-durable): for files rewritten every step, like a status.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import tempfile  # here, not at import: a no-op `retrainer warm-url` never writes a file

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    with atomic_writer(path, durable=durable) as fh:
        fh.write(data)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def leads_outside(root: str | os.PathLike[str], rel: str) -> Path | None:
    """Where `root/rel` leads, symlinks resolved, when that is outside `root` (resolved too); None when it stays
    inside. Why resolve: a name inside a folder may still lead out of it (`..`, an absolute name, a symlink to a
    credentials file elsewhere), and what is read, copied and published is where it leads. A symlink loop is
    refused (InvalidInputError)."""
    base = Path(root).resolve()
    try:
        target = (base / rel).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise InvalidInputError(f"{base / rel}: cannot be resolved: {exc}") from None
    return None if target.is_relative_to(base) else target


def is_local_fs(fs: Any) -> bool:
    """Whether an fsspec filesystem is this machine's own disk (then writes go through `atomic_writer`)."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def put_object(fs: Any, path: str, data: bytes) -> None:
    """Write one object through fsspec; on a local filesystem atomically (temp + fsync + rename)."""
    if is_local_fs(fs):
        atomic_write_bytes(path, data)
    else:
        fs.pipe_file(path, data)


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Apparent size of all files under path (0 if missing)."""
    total = 0
    stack = [Path(path)]
    while stack:
        p = stack.pop()
        try:
            entries = list(os.scandir(p))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
            else:
                with suppress(FileNotFoundError):
                    total += e.stat(follow_symlinks=False).st_size
    return total


def modified_at(info: dict[str, Any]) -> float | None:
    """When an fsspec listing entry was last written (epoch seconds), or None when the filesystem does not say:
    local `mtime`, S3 `LastModified`, GCS `updated`/`mtime`."""
    import datetime as dt

    value = info.get("mtime", info.get("LastModified", info.get("updated")))
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    return None


def sha256_file(path: str | os.PathLike[str], also: Callable[[bytes], None] | None = None) -> str:
    """The file's sha256; `also` sees every chunk as it is hashed (one read serves both)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if also is not None:
                also(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under root (bottom-up)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@contextmanager
def fresh_dir(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside `dest`; on clean exit it is fsynced and renamed onto `dest`.

    `dest` must be absent or an empty directory (else InvalidInputError): a download never mixes
    into other files. On error the temporary directory is removed and `dest` is left as it was.
    A symlink `dest` is refused as one, before anything is written: the finished directory is renamed onto
    `dest`, which cannot replace a link without deleting it (whatever else follows the link, such as a
    serving pointer, would silently lose it), and filling the link's target would write where the caller
    did not name.
    """
    import shutil
    import tempfile

    dest = Path(dest)
    if dest.is_symlink():
        raise InvalidInputError(f"{dest}: destination is a symlink (to {os.readlink(dest)}); give a directory "
                                "path that is not a link")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidInputError(f"{dest}: destination exists and is not an empty directory; choose a new one")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        try:
            os.rename(tmp, dest)  # replaces an empty directory; fails on a non-empty one
        except OSError as exc:
            raise InvalidInputError(f"{dest}: destination was filled meanwhile ({exc.strerror})") from None
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
