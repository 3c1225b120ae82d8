"""ObjectFile: O_DIRECT writes from aligned buffers give back exactly the bytes written, at any size and chunking;
a filesystem that refuses O_DIRECT gets buffered writes; an abort leaves nothing."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tasks.fetch.direct import ALIGN, BUFFER, BufferPool, ObjectFile
from tests.services import require


def _write(tmp: Path, data: bytes, rng: random.Random, pool: BufferPool, direct: bool) -> ObjectFile:
    out = ObjectFile(tmp, pool, direct=direct)
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 7, ALIGN - 1, ALIGN, 65536, BUFFER - 3, BUFFER, 3 * BUFFER + 5])
        out.write(memoryview(data)[pos:pos + n])
        pos += n
    fd = out.close()
    os.fsync(fd)
    os.close(fd)
    return out


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUFFER - 1, BUFFER, BUFFER + 1,
                                  3 * BUFFER + 12345])
@pytest.mark.parametrize("direct", [True, False])
def test_bytes_round_trip_any_size_and_chunking(tmp_path: Path, size: int, direct: bool) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    pool = BufferPool()
    out = _write(tmp_path / "obj.part", data, rng, pool, direct)
    assert (tmp_path / "obj.part").read_bytes() == data
    assert out.size == size
    if direct and hasattr(os, "O_DIRECT"):
        assert out.direct  # the test's own filesystem takes O_DIRECT (ext4 in CI)
    reused = pool.get()  # the buffer went back to the pool
    assert len(reused) == BUFFER
    pool.close()


def test_tmpfs_writes_whether_or_not_it_takes_o_direct() -> None:
    shm = Path("/dev/shm")
    require(shm.is_dir(), "a tmpfs at /dev/shm")
    tmp = shm / f"retrainer-test-{os.getpid()}.part"
    try:
        data = random.Random(1).randbytes(BUFFER + 999)
        _write(tmp, data, random.Random(2), BufferPool(), True)
        assert tmp.read_bytes() == data
    finally:
        tmp.unlink(missing_ok=True)


def test_abort_removes_the_temp_file(tmp_path: Path) -> None:
    out = ObjectFile(tmp_path / "x.part", BufferPool(), direct=True)
    out.write(b"partial")
    out.abort()
    assert not (tmp_path / "x.part").exists()
