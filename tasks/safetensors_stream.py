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

from tasks.errors import InvalidInputError

# torch dtype -> safetensors' name for it (the ones an export writes, and their neighbours).
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


def write(sink: Any, entries: Sequence[TensorEntry], tensors: Iterable[tuple[str, torch.Tensor]],
          metadata: dict[str, str] | None = None) -> None:
    """Write the header of `entries`, then each tensor `tensors` yields, in the same order, checked against
    its entry (name, dtype, shape). Each tensor goes to `sink.write` as a view of its own memory, which the
    sink may hold until its next write returns (`tasks.fastcopy.HashingWriter` does): one tensor is in
    flight while the caller makes the next."""
    sink.write(header(entries, metadata))
    count = 0
    for name, tensor in tensors:
        entry = entries[count] if count < len(entries) else None
        got = (name, tensor.dtype, tuple(tensor.shape))
        if entry is None or got != (entry.name, entry.dtype, entry.shape):
            said = "nothing" if entry is None else (entry.name, entry.dtype, entry.shape)
            raise InvalidInputError(f"safetensors: tensor {count} is {got}, the header says {said}")
        # A view of the tensor's own memory: the sink's buffer reference keeps it alive until written.
        sink.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        count += 1
    if count != len(entries):
        raise InvalidInputError(f"safetensors: {count} tensors written, the header lists {len(entries)}")
