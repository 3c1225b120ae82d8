"""Input files -> chunks of whole rows (~1 MiB each), read as a stream in the main process.

Reading stays cheap here (byte splits, Parquet record batches) so that parsing
and tokenizing, the expensive part, happen in the workers. Memory: one chunk being
built, plus Parquet's current row group; never a whole file. A single document
must fit in memory (a JSONL line, a text block, a Parquet value).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from tasks.base.errors import InvalidInputError
from tasks.data.prepare.chunks import Chunk
from tasks.data.prepare.inputs import InputFile

CHUNK_BYTES = 1 << 20
# A chunk of plain text ends right after a blank line, so no block straddles two chunks.
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")


def chunks(files: list[InputFile], column: str, chat: bool = False) -> Iterator[Chunk]:
    """Every file's chunks, file after file, in order (`chat`: a Parquet column may hold lists of messages)."""
    for index, file in enumerate(files):
        try:
            if file.kind == "parquet":
                yield from _parquet(index, file, column, chat)
            else:
                yield from _lines(index, file, _line_cut if file.kind == "jsonl" else _block_cut)
        except OSError as exc:
            raise InvalidInputError(f"{file.name}: cannot read: {exc}") from None


def _line_cut(block: bytes) -> int:
    return block.rfind(b"\n") + 1


def _block_cut(block: bytes) -> int:
    ends = [m.end() for m in _BLANK_LINE.finditer(block)]
    return ends[-1] if ends else 0


def _lines(index: int, file: InputFile, cut_at: Callable[[bytes], int]) -> Iterator[Chunk]:
    """Cut the byte stream after the last row boundary of each read; a longer row keeps accumulating."""
    line, parts = 1, []
    with file.open() as fh:
        while block := fh.read(CHUNK_BYTES):
            cut = cut_at(block)
            if not cut:
                parts.append(block)
                continue
            payload = b"".join([*parts, block[:cut]])
            parts = [block[cut:]]
            yield Chunk(index, file.kind, line, payload, len(payload))
            line += payload.count(b"\n")
    if tail := b"".join(parts):
        yield Chunk(index, file.kind, line, tail, len(tail))


def _parquet(index: int, file: InputFile, column: str, chat: bool) -> Iterator[Chunk]:
    """Record batches of the one column, sized from the file's metadata to ~CHUNK_BYTES of values.

    String values travel as raw bytes (viewed as binary, no copy): the workers decode them, so
    invalid UTF-8 written by a non-validating writer is a bad row, not a crash here. A chat
    column of lists (messages as structs) travels as Python lists.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    with file.open() as fh:
        try:
            pf = pq.ParquetFile(fh)
        except (pa.ArrowException, OSError) as exc:
            raise InvalidInputError(f"{file.name}: not a Parquet file: {exc}") from None
        schema = pf.schema_arrow
        if column not in schema.names:
            raise InvalidInputError(f"{file.name}: no column {column!r} (columns: {', '.join(schema.names)}): "
                                    f"pass --column")
        kind = schema.field(column).type
        raw_type = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(),
                    pa.string_view(): pa.binary_view()}.get(kind)
        as_lists = chat and (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        if raw_type is None and not as_lists:
            raise InvalidInputError(f"{file.name}: column {column!r} holds {kind}, not "
                                    f"{'strings or lists' if chat else 'strings'}")
        meta = pf.metadata
        total_rows = max(1, meta.num_rows)
        raw = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        batch_rows = max(1, min(1 << 16, CHUNK_BYTES * total_rows // max(1, raw)))
        row = 1
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=[column]):
                values = (batch.column(0) if as_lists else batch.column(0).view(raw_type)).to_pylist()
                end = row + len(values)
                done = file.size * (end - 1) // total_rows - file.size * (row - 1) // total_rows
                yield Chunk(index, "parquet", row, values, done)
                row = end
        except pa.ArrowException as exc:
            raise InvalidInputError(f"{file.name}: unreadable Parquet near row {row}: {exc}") from None
