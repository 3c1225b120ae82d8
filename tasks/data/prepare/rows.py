"""Rows of a chunk -> documents, counting the bad ones with the line (or row) of the first.

A bad row is skipped, never guessed at: a JSONL line that is not JSON, not an
object, lacks the text field or holds a non-string there; a text block that is
not valid UTF-8; a null or non-UTF-8 Parquet value. Blank lines are not rows.

Plain text: one document per block of non-blank lines (a blank line is empty or
whitespace only); a document keeps its inner newlines and loses the final one.

Chat (`messages`): the field holds a list of messages (JSONL; Parquet: a list<struct> column, or a string
column of JSON lists); its shape is checked where it is rendered (`chat.check_messages`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tasks.data.prepare.chunks import Chunk


@dataclass
class Rows:
    docs: list[Any] = field(default_factory=list)  # texts, or (chat) message lists
    lines: list[int] = field(default_factory=list)  # each document's line (or row)
    rows: int = 0
    bad: int = 0
    first_bad: tuple[int, str] | None = None

    def add(self, line: int, text: Any) -> None:
        self.rows += 1
        self.docs.append(text)
        self.lines.append(line)

    def reject(self, line: int, reason: str) -> None:
        self.rows += 1
        self.bad += 1
        if self.first_bad is None:
            self.first_bad = (line, reason)


def parse(chunk: Chunk, text_field: str, chat: bool = False) -> Rows:
    """The documents of one chunk, in order (`chat`: `text_field` holds each row's messages)."""
    if chunk.kind == "jsonl":
        return _jsonl(chunk.payload, chunk.first_row, text_field, list if chat else str)  # type: ignore[arg-type]
    if chunk.kind == "text":
        return _text(chunk.payload, chunk.first_row)  # type: ignore[arg-type]
    if chat:
        return _messages(chunk.payload, chunk.first_row)  # type: ignore[arg-type]
    return _values(chunk.payload, chunk.first_row)  # type: ignore[arg-type]


def _usable(text: str) -> bool:
    """JSON may carry lone surrogates (`"\\ud800"`), which no tokenizer accepts."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _jsonl(payload: bytes, first_line: int, text_field: str, kind: type) -> Rows:
    out = Rows()
    for i, line in enumerate(payload.split(b"\n")):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except UnicodeDecodeError:
            out.reject(first_line + i, "invalid UTF-8")
            continue
        except ValueError:
            out.reject(first_line + i, "not valid JSON")
            continue
        if not isinstance(obj, dict):
            out.reject(first_line + i, f"not a JSON object (got {type(obj).__name__})")
        elif text_field not in obj:
            out.reject(first_line + i, f"no field {text_field!r}")
        elif not isinstance(obj[text_field], kind):
            out.reject(first_line + i, f"field {text_field!r} is not a {'string' if kind is str else 'list'} "
                                       f"(got {type(obj[text_field]).__name__})")
        elif kind is str and not _usable(obj[text_field]):
            out.reject(first_line + i, f"field {text_field!r} holds a lone surrogate")
        else:
            out.add(first_line + i, obj[text_field])
    return out


def _text(payload: bytes, first_line: int) -> Rows:
    out = Rows()
    block: list[bytes] = []
    start = first_line
    for i, line in enumerate([*payload.split(b"\n"), b""]):
        if line.strip():
            if not block:
                start = first_line + i
            block.append(line)
            continue
        if not block:
            continue
        raw = b"\n".join(block).removesuffix(b"\r")
        block = []
        try:
            out.add(start, raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.reject(start + raw.count(b"\n", 0, exc.start), "invalid UTF-8")
    return out


def _values(values: list[bytes | None], first_row: int) -> Rows:
    out = Rows()
    for i, value in enumerate(values):
        if value is None:
            out.reject(first_row + i, "null value")
            continue
        try:
            out.add(first_row + i, value.decode("utf-8"))
        except UnicodeDecodeError:
            out.reject(first_row + i, "invalid UTF-8")
    return out


def _messages(values: list[Any], first_row: int) -> Rows:
    """Parquet chat rows: a list<struct> value is the messages; a string value is their JSON."""
    out = Rows()
    for i, value in enumerate(values):
        if isinstance(value, bytes):
            try:
                value = json.loads(value)
            except ValueError:
                out.reject(first_row + i, "not valid JSON")
                continue
        if not isinstance(value, list):
            out.reject(first_row + i, f"messages is not a list (got {type(value).__name__})")
            continue
        # Arrow gives every struct field to every message: a field a message did not have is None; drop it.
        out.add(first_row + i, [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                                for m in value])
    return out
