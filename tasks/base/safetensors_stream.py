"""Write a safetensors file as a stream, one tensor at a time: the header first, then each tensor's bytes.

Why not `safetensors.torch.save_file`: it needs every tensor in memory at once (a whole pipeline stage) and
a local file, which the export then copied a second time into the store. The format allows streaming: an
8-byte little-endian header length, the JSON header (each tensor's dtype, shape and `data_offsets` into
the data section, plus `__metadata__`) padded with spaces to a multiple of 8, then the tensors' raw bytes,
back to back in offset order. Knowing every name, dtype and shape up front is enough to write the header.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tasks.base.errors import InvalidInputError

# torch dtype -> safetensors' name for it (the ones an export writes, and their neighbours).
PIECE = 16 << 20  # bytes converted and handed to the sink at a time
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorEntry:
    """What the header says of one tensor, before its bytes exist."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The file's first bytes: length prefix and padded JSON header, with offsets in the order given."""
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        if e.name in doc or e.name == "__metadata__":
            raise InvalidInputError(f"safetensors: tensor {e.name!r} is listed twice")
        if e.dtype not in DTYPE_NAMES:
            raise InvalidInputError(f"safetensors: tensor {e.name!r} has unsupported dtype {e.dtype}")
        doc[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _Pieces:
    """Two host buffers per dtype that the conversions take turns to fill: a sink holds a piece until its next
    write returns, so two are enough; allocated once, not per piece (a fresh 16 MiB tensor per piece spent
    more on page faults than on converting)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._turn = 0

    def next(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        if dtype not in self._buffers:
            self._buffers[dtype] = (torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype))
        self._turn ^= 1
        return self._buffers[dtype][self._turn]


def write(sink: Any, entries: Sequence[TensorEntry], tensors: Iterable[tuple[str, torch.Tensor]],
          metadata: dict[str, str] | None = None, piece_bytes: int = PIECE) -> None:
    """Write the header of `entries`, then each tensor `tensors` yields, in the same order, checked against
    its entry (name, shape), converted to the entry's dtype on the host piece by piece (`piece_bytes`):
    host memory holds a few pieces, not a tensor in the file's dtype, and a slow sink overlaps the
    conversion. Each piece goes to `sink.write`, which may hold it until its next write returns
    (`tasks.base.fastcopy.HashingWriter` does)."""
    sink.write(header(entries, metadata))
    pieces = _Pieces()
    count = 0
    for name, tensor in tensors:
        entry = entries[count] if count < len(entries) else None
        got = (name, tuple(tensor.shape))
        if entry is None or got != (entry.name, entry.shape):
            said = "nothing" if entry is None else (entry.name, entry.shape)
            raise InvalidInputError(f"safetensors: tensor {count} is {got}, the header says {said}")
        flat = tensor.detach().reshape(-1)
        step = max(1, piece_bytes // entry.dtype.itemsize)
        as_is = flat.device.type == "cpu" and flat.dtype == entry.dtype
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            if not as_is:
                piece = pieces.next(entry.dtype, step)[:piece.numel()].copy_(piece)
            sink.write(piece.view(torch.uint8).numpy())
        count += 1
    if count != len(entries):
        raise InvalidInputError(f"safetensors: {count} tensors written, the header lists {len(entries)}")
