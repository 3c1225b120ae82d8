"""What travels between the reading main process and the tokenizing workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Chunk:
    """Whole rows of one input file: bytes of complete lines (jsonl, text) or raw values (parquet)."""

    file_index: int
    kind: str
    first_row: int  # 1-based line (jsonl, text) or row (parquet) where the payload starts
    payload: bytes | list[Any]
    nbytes: int  # input bytes this chunk accounts for (progress)


@dataclass
class ChunkResult:
    """One chunk tokenized: EOS-terminated ids per split (in the dataset dtype) and its row accounting.

    Chat: per split also the loss mask (uint8 per token) and each conversation's length in tokens; and the
    conversations skipped for having no assistant token, and the overlong ones cut or dropped."""

    file_index: int
    nbytes: int
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    masks: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    rows: int = 0
    bad: int = 0
    first_bad: tuple[int, str] | None = None
    no_assistant: int = 0
    truncated: int = 0
    dropped: int = 0

    def reject(self, line: int, reason: str) -> None:
        self.bad += 1
        if self.first_bad is None or line < self.first_bad[0]:
            self.first_bad = (line, reason)
