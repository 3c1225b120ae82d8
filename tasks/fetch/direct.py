"""Writing a large object to its temp file with O_DIRECT, from reused page-aligned buffers.

Through the page cache every 4 KiB costs a page allocation and a copy, and the cache fills
with a dataset the trainer streams once anyway: on the 2-core dev VM 512 MiB took 1.2-1.5 s
of CPU buffered + fsync and 0.05-0.2 s with O_DIRECT (`dd`, BENCHMARKS.md). The bytes are
copied into an aligned buffer from a small pool (its pages stay mapped, so they are faulted
in once per warm, not once per object) and written a buffer at a time; the last block is
padded and the file truncated to its real size. A filesystem that refuses O_DIRECT (EINVAL,
e.g. some tmpfs and FUSE mounts) gets ordinary buffered writes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from typing import Any

ALIGN = 4096  # offsets, lengths and buffer addresses of O_DIRECT I/O (logical block size <= a page)
BUFFER = 8 << 20


def write_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class BufferPool:
    """Page-aligned anonymous buffers, reused across objects; thread-safe."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, BUFFER)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            for buf in self._free:
                # A view still held by an exception's traceback keeps it mapped until it is collected.
                with contextlib.suppress(BufferError):
                    buf.close()
            self._free.clear()


class ObjectFile:
    """One object written sequentially to a new temp file; O_DIRECT unless `direct` is off or refused."""

    def __init__(self, tmp: str, pool: BufferPool, *, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self.tmp = tmp
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(tmp, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with contextlib.suppress(FileNotFoundError):  # some filesystems create it, then refuse the flag
                    os.unlink(tmp)
        if not self.direct:
            self.fd = os.open(tmp, flags, 0o644)
        self._pool = pool
        self._buf = pool.get() if self.direct else None
        self._fill = 0  # bytes waiting in the buffer
        self._flushed = 0  # bytes written to the file (a multiple of BUFFER while direct)
        self.size = 0  # bytes accepted so far

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        buf = self._buf
        if buf is None:
            write_all(self.fd, view, self.size)
            self.size += len(view)
            return
        self.size += len(view)
        while view:
            n = min(len(view), BUFFER - self._fill)
            buf[self._fill:self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == BUFFER:
                write_all(self.fd, buf, self._flushed)
                self._flushed += BUFFER
                self._fill = 0

    def close(self) -> int:
        """Write what is buffered and hand back the descriptor (still open) for fsync + rename."""
        buf = self._buf
        if buf is not None and self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            buf[self._fill:padded] = bytes(padded - self._fill)
            write_all(self.fd, memoryview(buf)[:padded], self._flushed)
            os.ftruncate(self.fd, self.size)
        self._release()
        return self.fd

    def abort(self) -> None:
        self._release()
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def _release(self) -> None:
        if self._buf is not None:
            self._pool.put(self._buf)
            self._buf = None
