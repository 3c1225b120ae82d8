"""The tokenizing side: one chunk -> documents -> EOS-terminated ids per split.

Runs in worker processes, set up once by `init`. A result depends on its chunk
alone, which is what makes the output the same for any `--workers`. Each worker
tokenizes on one thread (TOKENIZERS_PARALLELISM=false): the processes are the
parallelism, and N workers x N Rayon threads would only oversubscribe the cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import chain
from typing import Any

from tasks.base.dataset_format import SPLITS
from tasks.data.prepare.chunks import Chunk, ChunkResult
from tasks.data.prepare.rows import parse
from tasks.data.prepare.split import heldout_threshold, is_heldout


@dataclass(frozen=True)
class Settings:
    tokenizer_path: str
    eos_id: int
    text_field: str
    heldout_fraction: float
    np_dtype: str


_settings: Settings | None = None
_tokenizer: Any = None


def init(settings: Settings) -> None:
    """Pool initializer: load the tokenizer once per process."""
    global _settings, _tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _settings, _tokenizer = settings, Tokenizer.from_file(settings.tokenizer_path)


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """Documents are encoded without the tokenizer's special-token template (no BOS), each followed by EOS."""
    import numpy as np

    assert _settings is not None, "init() first"
    rows = parse(chunk, _settings.text_field)
    result = ChunkResult(chunk.file_index, chunk.nbytes, rows=rows.rows, bad=rows.bad, first_bad=rows.first_bad)
    threshold = heldout_threshold(_settings.heldout_fraction)
    held = [is_heldout(doc, threshold) for doc in rows.docs]
    ids = [e.ids for e in _tokenizer.encode_batch_fast(rows.docs, add_special_tokens=False)]
    eos = (_settings.eos_id,)
    for split in SPLITS:
        mine = [doc_ids for doc_ids, h in zip(ids, held, strict=True) if h == (split == "heldout")]
        count = sum(len(doc_ids) for doc_ids in mine) + len(mine)
        flat = chain.from_iterable(chain(doc_ids, eos) for doc_ids in mine)
        result.tokens[split] = np.fromiter(flat, dtype=_settings.np_dtype, count=count)
        result.documents[split] = len(mine)
    return result
