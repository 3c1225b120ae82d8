"""The tokenizing side: one chunk -> documents -> EOS-terminated ids per split (chat: rendered conversations,
their loss masks and lengths).

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

from tasks.base.dataset_format import MASK_DTYPE, SPLITS
from tasks.data.manifest import Overlong
from tasks.data.prepare.chat import BadConversation, ChatTemplate, assistant_mask, check_messages, has_assistant, render
from tasks.data.prepare.chunks import Chunk, ChunkResult
from tasks.data.prepare.rows import Rows, parse
from tasks.data.prepare.split import heldout_threshold, is_heldout


@dataclass(frozen=True)
class ChatSettings:
    template: ChatTemplate
    seq_len: int  # a longer conversation is cut to this many tokens, or dropped:
    overlong: Overlong


@dataclass(frozen=True)
class Settings:
    tokenizer_path: str
    eos_id: int
    text_field: str
    heldout_fraction: float
    np_dtype: str
    chat: ChatSettings | None = None


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
    rows = parse(chunk, _settings.text_field, chat=_settings.chat is not None)
    result = ChunkResult(chunk.file_index, chunk.nbytes, rows=rows.rows, bad=rows.bad, first_bad=rows.first_bad)
    if _settings.chat is not None:
        return _conversations(rows, _settings.chat, result)
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


def _conversations(rows: Rows, chat: ChatSettings, result: ChunkResult) -> ChunkResult:
    """Each conversation rendered with the template, encoded with the same tokenizer (the template writes the
    special tokens, EOS included where it does: nothing is appended), its mask beside it."""
    import numpy as np

    assert _settings is not None
    threshold = heldout_threshold(_settings.heldout_fraction)
    kept: dict[str, list[tuple[list[int], list[int]]]] = {split: [] for split in SPLITS}
    for line, doc in zip(rows.lines, rows.docs, strict=True):
        try:
            messages = check_messages(doc)
            if not has_assistant(messages):
                result.no_assistant += 1
                continue
            text, spans = render(chat.template, messages)
        except BadConversation as exc:
            result.reject(line, str(exc))
            continue
        encoding = _tokenizer.encode(text, add_special_tokens=False)
        ids, mask = encoding.ids, assistant_mask(encoding.offsets, spans)
        if len(ids) > chat.seq_len:
            if chat.overlong == "drop":
                result.dropped += 1
                continue
            ids, mask = ids[:chat.seq_len], mask[:chat.seq_len]
            result.truncated += 1
        if not any(mask):  # the template rendered no assistant token (or the cut removed them all)
            result.no_assistant += 1
            continue
        kept["heldout" if is_heldout(text, threshold) else "train"].append((ids, mask))
    for split, docs in kept.items():
        result.tokens[split] = np.array([t for ids, _ in docs for t in ids], dtype=_settings.np_dtype)
        result.masks[split] = np.array([b for _, mask in docs for b in mask], dtype=MASK_DTYPE)
        result.lengths[split] = np.array([len(ids) for ids, _ in docs], dtype=np.int64)
        result.documents[split] = len(docs)
    return result
