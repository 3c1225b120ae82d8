"""tasks.base.fastcopy: every byte copied once, hashed on the way, files in parallel; a failed copy leaves nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tasks.base.fastcopy import BUFFER, SLICE, HashingWriter, copy_file, copy_files


def test_copy_files_gives_the_same_bytes_and_their_sha256_whatever_the_size(tmp_path: Path) -> None:
    sizes = {"empty": 0, "one": 1, "buffer": BUFFER, "buffer-plus-one": BUFFER + 1, "three": 3 * BUFFER - 7}
    pairs = []
    for name, size in sizes.items():
        (tmp_path / "src" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "src" / name).write_bytes(os.urandom(size))
        pairs.append((tmp_path / "src" / name, tmp_path / "dst" / "nested" / name))

    got = copy_files(pairs)

    for (src, dest), (digest, size) in zip(pairs, got, strict=True):
        data = src.read_bytes()
        assert dest.read_bytes() == data
        assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))


def test_a_copy_from_a_missing_file_raises_and_leaves_no_destination(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a" * 10)
    with pytest.raises(FileNotFoundError):
        copy_files([(tmp_path / "a", tmp_path / "out" / "a"), (tmp_path / "missing", tmp_path / "out" / "missing")])
    assert not (tmp_path / "out" / "missing").exists()
    with pytest.raises(IsADirectoryError):
        copy_file(tmp_path / "a", tmp_path)  # dest is a folder: nothing written, source untouched
    assert (tmp_path / "a").read_bytes() == b"a" * 10


class _Upload:
    """A sink that is no OS file (as an fsspec upload is not): takes some bytes per call, keeps them."""

    def __init__(self) -> None:
        self.got = bytearray()

    def write(self, data: memoryview) -> int:
        self.got += data
        return len(data)


def test_a_hashing_writer_gives_the_bytes_and_their_sha256_into_a_local_file_and_into_an_upload(
        tmp_path: Path) -> None:
    data = os.urandom(3 * SLICE + 11)
    pieces = [data[:5], data[5:2 * SLICE + 1], data[2 * SLICE + 1:]]  # across slice borders, a tiny one first
    upload = _Upload()
    with open(tmp_path / "out", "wb", buffering=0) as local:
        for sink in (local, upload):
            writer = HashingWriter(sink)
            for piece in pieces:
                writer.write(piece)
            assert writer.finish() == (hashlib.sha256(data).hexdigest(), len(data))
    assert (tmp_path / "out").read_bytes() == data
    assert bytes(upload.got) == data
