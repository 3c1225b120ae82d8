"""What a pretrained model folder must be to enter the cache, checked once, as its files are copied in.

Why at the warm: every byte of a weights file is read there anyway (copied and hashed), so checking every
float finite costs one more look at bytes already in memory (a test of each element's exponent bits: 7-14
GB/s on one core here, against sha256's 1.7 GB/s beside it), never a second read of a 140 GB model. A NaN
weight would otherwise train, evaluate and publish, an Inf one fail only in the ranks ("non-finite loss at
step 1"). The header facts (every tensor's shape and dtype as config.json says) and the tokenizer's ids
(each below vocab_size) are checked on the copy before it takes its name in the cache
(tasks/models/pretrained.py): a refused folder leaves nothing there, and a cached one is not checked again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.base.errors import InvalidInputError
from tasks.base.model_files import HF_CONFIG
from tasks.base.safetensors_stream import DTYPE_NAMES
from tasks.config.model import ModelConfig
from tasks.models.weights import HFWeights, check_shapes

# The float dtypes (safetensors' names) a model's weights may start from -> (each element as an unsigned
# little-endian integer, its exponent bits): an element is NaN or Inf iff all its exponent bits are set.
FLOAT_BITS = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000),
              "F64": ("<u8", 0x7FF0000000000000)}
# config.json's `dtype` (`torch_dtype` before transformers 4.56; torch's names) -> safetensors' name.
CONFIG_DTYPES = {str(t).removeprefix("torch."): name for t, name in DTYPE_NAMES.items() if name in FLOAT_BITS}
TOKENIZER = "tokenizer.json"
SCAN = 1 << 20  # bytes tested at a time: the test's scratch stays in the core's cache
MAX_HEADER = 100_000_000  # the safetensors format's own limit on a header


@dataclass(frozen=True)
class _Span:
    """A float tensor's bytes in its file: [start, end) from the file's first byte."""

    name: str
    dtype: str
    start: int
    end: int


class FiniteCheck:
    """Checks every float element of one safetensors file finite as its bytes stream past, in order (a copy's
    pieces, of any sizes): the header from the first bytes, then each tensor piece by piece, in bounded slices
    (no tensor is ever materialised, nor converted). `feed` each piece, then `finish`; InvalidInputError names
    `label`, the tensor and its first bad flat index."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._seen = 0  # bytes of the file seen so far
        self._head = bytearray()  # the header's bytes until they are all in
        self._spans: list[_Span] | None = None  # the float tensors by offset, once the header is in
        self._size = 0  # the file's size as its header describes it
        self._next = 0  # the first span not yet wholly seen
        self._carry = bytearray()  # the start of an element the last piece cut
        self._scratch = np.empty(SCAN, np.uint8)

    def feed(self, piece: memoryview) -> None:
        view = memoryview(piece).cast("B")
        at = self._seen
        self._seen += view.nbytes
        if self._spans is None:
            view, at = self._take_header(view, at)
        end = at + view.nbytes
        while self._spans is not None and self._next < len(self._spans):
            span = self._spans[self._next]
            if span.start >= end:
                return
            lo, hi = max(span.start, at), min(span.end, end)
            if lo < hi:
                self._scan(span, lo, view[lo - at:hi - at])
            if span.end > end:
                return
            self._next += 1

    def finish(self) -> None:
        """Once the last piece is fed: refuse a file shorter or longer than its header says."""
        if self._spans is None:
            raise InvalidInputError(f"{self.label}: a truncated safetensors file ({self._seen} bytes); refused")
        if self._seen != self._size:
            raise InvalidInputError(f"{self.label}: {self._seen} bytes, its safetensors header describes "
                                    f"{self._size}; refused")

    def _take_header(self, view: memoryview, at: int) -> tuple[memoryview, int]:
        """Gather the header's bytes; once all are in, parse it. The rest of `view` (data) and where it starts."""
        while view.nbytes and self._spans is None:
            need = 8 + (int.from_bytes(self._head[:8], "little") if len(self._head) >= 8 else 0)
            part = view[:need - len(self._head)]
            self._head += part
            view, at = view[part.nbytes:], at + part.nbytes
            if len(self._head) == 8 and not 2 <= int.from_bytes(self._head, "little") <= MAX_HEADER:
                raise InvalidInputError(f"{self.label}: not a safetensors file (its first 8 bytes give a "
                                        f"{int.from_bytes(self._head, 'little')}-byte header)")
            if len(self._head) == need > 8:
                self._spans = self._parse(bytes(self._head[8:]), need)
        return view, at

    def _parse(self, raw: bytes, base: int) -> list[_Span]:
        """The float tensors' spans, checked to be whole elements and apart from each other."""
        try:
            header = json.loads(raw)
            entries = [(name, e["dtype"], int(e["data_offsets"][0]), int(e["data_offsets"][1]))
                       for name, e in header.items() if name != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise InvalidInputError(f"{self.label}: not a safetensors file (header: {exc!r})") from None
        self._size = base + max((end for *_, end in entries), default=0)
        spans = sorted((_Span(name, dtype, base + b, base + e) for name, dtype, b, e in entries
                        if dtype in FLOAT_BITS), key=lambda s: s.start)
        last = base
        for span in spans:
            itemsize = np.dtype(FLOAT_BITS[span.dtype][0]).itemsize
            if span.start < last or span.end < span.start or (span.end - span.start) % itemsize:
                raise InvalidInputError(f"{self.label}: malformed safetensors header: tensor {span.name}'s "
                                        "data_offsets overlap another's or cut an element")
            last = span.end
        return spans

    def _scan(self, span: _Span, at: int, data: memoryview) -> None:
        """Test the elements of `span` in `data` (its bytes from file offset `at`); an element cut by a piece's
        end is kept and tested whole with the next piece."""
        itemsize = np.dtype(FLOAT_BITS[span.dtype][0]).itemsize
        if self._carry:
            take = itemsize - len(self._carry)
            self._carry += data[:take]
            data, at = data[take:], at + take
            if len(self._carry) < itemsize:
                return
            self._test(span, at - itemsize, memoryview(bytes(self._carry)))
            self._carry = bytearray()
        whole = data.nbytes - data.nbytes % itemsize
        self._test(span, at, data[:whole])
        self._carry = bytearray(data[whole:])

    def _test(self, span: _Span, at: int, data: memoryview) -> None:
        dtype, exponent = FLOAT_BITS[span.dtype]
        for start in range(0, data.nbytes, SCAN):
            values = np.frombuffer(data[start:start + SCAN], dtype)
            bits = np.bitwise_and(values, np.array(exponent, dtype), out=self._scratch.view(dtype)[:values.size])
            if bits.max() != exponent:
                continue
            i = int(np.flatnonzero(bits == exponent)[0])
            kind = "NaN" if int(values[i]) & _mantissa(dtype, exponent) else "Inf"
            index = (at + start - span.start) // values.itemsize + i
            raise InvalidInputError(f"{self.label}: tensor {span.name} holds {kind} at flat index {index}; "
                                    "refused (a non-finite weight trains and publishes a broken model)")


def _mantissa(dtype: str, exponent: int) -> int:
    """The mantissa bits of a float format: below the sign, not the exponent (set in a NaN, clear in an Inf)."""
    return ((1 << (8 * np.dtype(dtype).itemsize - 1)) - 1) & ~exponent


def check_folder(path: Path, m: ModelConfig, label: str) -> None:
    """The header facts of a model folder's copy, before it takes its name in the cache: every tensor the
    model has, of the shape config.json implies, of a float dtype (the one config.json names, if any), and
    every tokenizer id below vocab_size. InvalidInputError naming `label`, the file and the tensor or token."""
    check_shapes(path, m, label=label)
    want = _config_dtype(path / HF_CONFIG, label)
    weights = HFWeights(path, m)
    for file, hf in sorted(weights.tensors()):
        dtype = weights.handles[file].get_slice(hf).get_dtype()
        if dtype not in FLOAT_BITS or (want is not None and dtype != want):
            said = f"config.json says {want}" if want else f"a model's weights are one of {', '.join(FLOAT_BITS)}"
            raise InvalidInputError(f"{label}: {file}: tensor {hf} is {dtype}, {said}; refused")
    check_tokenizer(path / TOKENIZER, m.vocab_size, f"{label}: {TOKENIZER}")


def _config_dtype(path: Path, label: str) -> str | None:
    """The safetensors dtype config.json names for the weights (`dtype`, or the older `torch_dtype`), if any."""
    try:
        config = json.loads(path.read_bytes())
        return CONFIG_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidInputError(f"{label}: unreadable {HF_CONFIG}: {exc!r}") from None


def check_tokenizer(path: Path, vocab_size: int, label: str) -> None:
    """Every id a tokenizer.json can produce (its model's vocabulary and its added tokens) names a row of the
    embedding: below `vocab_size`. A larger one would index past the embedding in a rank, or publish a
    tokenizer the model cannot serve. No tokenizer.json: nothing to check."""
    if not path.is_file():
        return
    try:
        doc = json.loads(path.read_bytes())
        vocab = doc["model"].get("vocab", {})
        ids = list(vocab.items()) if isinstance(vocab, dict) else [(entry[0], i) for i, entry in enumerate(vocab)]
        ids += [(t.get("content"), t.get("id")) for t in doc.get("added_tokens") or []]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise InvalidInputError(f"{label}: unreadable tokenizer: {exc!r}") from None
    bad = [(token, i) for token, i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise InvalidInputError(f"{label}: token {bad[0][0]!r} has id {bad[0][1]!r}, not a token id; refused")
    if ids and (top := max(ids, key=lambda t: t[1]))[1] >= vocab_size:
        raise InvalidInputError(f"{label}: token {top[0]!r} has id {top[1]}, config.json's vocab_size is "
                                f"{vocab_size} (the model has no embedding row for it); refused")
