"""`prepare`: input files -> tokenized shards + manifest, streamed in input order with bounded memory.

Memory: the reader runs at most 2 x workers chunks (~1 MiB each) ahead of the
writer. `Executor.map` and `Pool.imap` would both pull the whole input ahead of
the slowest worker (the corpus would end up in RAM), so submission is bounded here.
Order: results are written in submission order, and each depends on its chunk
alone, so the bytes are the same for any `--workers`.
Bad input: counted per file; a file above `max_bad_fraction`, or a corpus without a
document, stops the run (exit 2) and removes the shards written so far: a failed
run leaves no manifest at the destination.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tasks.base.dataset_format import SPLITS, TOKEN_DTYPES, dtype_for_vocab
from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.data.manifest import OVERLONG, ChatFormat, Manifest
from tasks.data.prepare.chat import ChatTemplate, load_template
from tasks.data.prepare.chunks import Chunk, ChunkResult
from tasks.data.prepare.inputs import FORMATS, InputFile, expand
from tasks.data.prepare.progress import Progress
from tasks.data.prepare.readers import chunks
from tasks.data.prepare.shards import Destination, SplitWriter
from tasks.data.prepare.tokenizer import TokenizerInfo, load_tokenizer
from tasks.data.prepare.worker import ChatSettings, Settings, init, tokenize_chunk

log = logging.getLogger(__name__)


def default_workers() -> int:
    """The cores this process may run on (cgroup/affinity aware)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class PrepareOptions:
    inputs: list[str]
    tokenizer: str
    dest: str
    fmt: str = "auto"
    text_field: str = "text"
    column: str = "text"
    eos_token: str | None = None
    heldout_fraction: float = 0.01
    tokens_per_shard: int = 1 << 26
    workers: int = field(default_factory=default_workers)
    max_bad_fraction: float = 0.01
    name: str | None = None
    storage_options: dict[str, Any] | None = None
    overwrite: bool = False
    chat: bool = False  # rows hold conversations (`messages_field`), rendered with the tokenizer's chat template
    messages_field: str = "messages"  # the JSONL field / Parquet column of a chat row's messages
    seq_len: int | None = None  # chat: a longer conversation is handled as `overlong` says (both required)
    overlong: str | None = None

    def check(self) -> None:
        if self.fmt not in ("auto", *FORMATS):
            raise InvalidInputError(f"--format must be auto or one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise InvalidInputError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if not 0 <= self.max_bad_fraction <= 1:
            raise InvalidInputError(f"--max-bad-fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.tokens_per_shard < 1 or self.workers < 1:
            raise InvalidInputError("--tokens-per-shard and --workers must be at least 1")
        if self.chat and (self.seq_len is None or self.seq_len < 1 or self.overlong not in OVERLONG):
            raise InvalidInputError(f"--chat needs --seq-len (at least 1) and --overlong ({' or '.join(OVERLONG)}): "
                                    "what to do with a conversation longer than a training window")
        if not self.chat and (self.seq_len is not None or self.overlong is not None):
            raise InvalidInputError("--seq-len and --overlong apply to --chat data only")

    @property
    def field(self) -> str:
        """The JSONL field a row's document is read from."""
        return self.messages_field if self.chat else self.text_field


@dataclass
class FileStats:
    file: InputFile
    rows: int = 0
    bad: int = 0
    first_bad: tuple[int, str] | None = None
    documents: Counter[str] = field(default_factory=Counter)  # per split
    skipped: Counter[str] = field(default_factory=Counter)  # chat: no_assistant, truncated, dropped

    def add(self, result: ChunkResult) -> None:
        self.rows += result.rows
        self.bad += result.bad
        self.first_bad = self.first_bad or result.first_bad
        self.documents.update(result.documents)
        self.skipped.update(no_assistant=result.no_assistant, truncated=result.truncated, dropped=result.dropped)

    @property
    def where(self) -> str:
        assert self.first_bad is not None
        unit = "row" if self.file.kind == "parquet" else "line"
        return f"{unit} {self.first_bad[0]}: {self.first_bad[1]}"

    def check(self, max_bad_fraction: float) -> None:
        if not self.bad:
            return
        log.warning("%s: %d of %d rows bad, skipped (first: %s)", self.file.name, self.bad, self.rows, self.where)
        if self.bad / self.rows > max_bad_fraction:
            raise InvalidInputError(
                f"{self.file.name}: {self.where} ({self.bad} of {self.rows} rows bad, "
                f"{self.bad / self.rows:.1%} > --max-bad-fraction {max_bad_fraction:.1%})"
            )


def prepare(opts: PrepareOptions) -> dict[str, Any]:
    """Write the dataset; return the run's summary (what the CLI prints)."""
    opts.check()
    started = time.monotonic()
    files = expand(opts.inputs, opts.fmt, opts.storage_options)
    tok = load_tokenizer(opts.tokenizer, opts.eos_token)
    dtype = dtype_for_vocab(tok.vocab_size)
    template = load_template(Path(tok.path).parent) if opts.chat else None
    dest = Destination(opts.dest, opts.storage_options)
    dest.claim(opts.overwrite)
    writers = {split: SplitWriter(dest, split, dtype, opts.tokens_per_shard, chat=opts.chat) for split in SPLITS}
    stats = [FileStats(f) for f in files]
    log.info("prepare-data: %d files (%.1f MB) -> %s, %s tokens (vocab %d, EOS %r = %d), %d workers",
             len(files), sum(f.size for f in files) / 1e6, opts.dest, dtype, tok.vocab_size, tok.eos_token,
             tok.eos_id, opts.workers)
    try:
        _tokenize(files, opts, _settings(opts, tok, dtype, template), writers, stats)
        if opts.heldout_fraction and not writers["heldout"].tokens:
            log.warning("prepare-data: no document landed in the held-out split (too few documents?)")
        name = opts.name or dest.root.rstrip("/").rsplit("/", 1)[-1] or "dataset"
        chat = None if template is None else ChatFormat(template_sha256=template.sha256, mask_rule=template.mask_rule,
                                                        seq_len=opts.seq_len, overlong=opts.overlong)
        manifest = Manifest(name=name, dtype=dtype, vocab_size=tok.vocab_size,
                            files=[f for split in SPLITS for f in writers[split].close()], chat=chat)
        dest.write_manifest(manifest)
    except BaseException:
        written = [key for writer in writers.values() for key in writer.abort()]
        dest.remove(written)
        log.info("prepare-data: failed; removed the %d shards this run wrote, no manifest", len(written))
        raise
    return _summary(opts, tok, manifest, writers, stats, time.monotonic() - started)


def _settings(opts: PrepareOptions, tok: TokenizerInfo, dtype: str, template: ChatTemplate | None) -> Settings:
    chat = None
    if template is not None:
        assert opts.seq_len is not None and opts.overlong is not None  # checked
        chat = ChatSettings(template, opts.seq_len, opts.overlong)  # type: ignore[arg-type]
    return Settings(tokenizer_path=tok.path, eos_id=tok.eos_id, text_field=opts.field,
                    heldout_fraction=opts.heldout_fraction, np_dtype=TOKEN_DTYPES[dtype], chat=chat)


def _tokenize(files: list[InputFile], opts: PrepareOptions, settings: Settings, writers: dict[str, SplitWriter],
              stats: list[FileStats]) -> None:
    progress = Progress(sum(f.size for f in files))
    checked = 0  # files before this index are complete and were checked
    try:
        with ProcessPoolExecutor(opts.workers, mp_context=get_context("spawn"), initializer=init,
                                 initargs=(settings,)) as pool:
            column = opts.messages_field if opts.chat else opts.column
            for result in _in_order(pool, chunks(files, column, opts.chat), depth=2 * opts.workers):
                for st in stats[checked:result.file_index]:
                    st.check(opts.max_bad_fraction)
                checked = result.file_index
                stats[result.file_index].add(result)
                for split in SPLITS:
                    writers[split].write(result.tokens[split], result.masks.get(split), result.lengths.get(split))
                progress.update(result.nbytes, sum(t.size for t in result.tokens.values()))
    except BrokenProcessPool:
        raise RetrainerError("prepare-data: a tokenizer worker process died (killed, or out of memory)") from None
    finally:
        progress.close()
    for st in stats[checked:]:
        st.check(opts.max_bad_fraction)
    if not any(st.documents.total() for st in stats):
        names = ", ".join(f.name for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise InvalidInputError(f"{names}: no documents (empty corpus)")


def _in_order(pool: ProcessPoolExecutor, work: Iterator[Chunk], depth: int) -> Iterator[ChunkResult]:
    """Results in submission order, with at most `depth` chunks submitted and not yet consumed."""
    pending: deque[Future[ChunkResult]] = deque()
    try:
        for chunk in work:
            pending.append(pool.submit(tokenize_chunk, chunk))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def _summary(opts: PrepareOptions, tok: TokenizerInfo, manifest: Manifest, writers: dict[str, SplitWriter],
             stats: list[FileStats], seconds: float) -> dict[str, Any]:
    tokens = {split: writers[split].tokens for split in SPLITS}
    summary = {
        "dest": opts.dest,
        "name": manifest.name,
        "manifest_hash": manifest.hash,
        "dtype": manifest.dtype,
        "vocab_size": manifest.vocab_size,
        "eos_token": tok.eos_token,
        "eos_id": tok.eos_id,
        "files": len(stats),
        "documents": {split: sum(st.documents[split] for st in stats) for split in SPLITS},
        "tokens": tokens,
        "shards": {split: len(writers[split].files) for split in SPLITS},
        "bad_rows": {st.file.name: {"bad": st.bad, "rows": st.rows, "first": st.where} for st in stats if st.bad},
        "workers": opts.workers,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(tokens.values()) / max(seconds, 1e-9)),
    }
    if manifest.chat is not None:  # a plain-text summary stays as it was
        skipped = sum((st.skipped for st in stats), Counter())
        summary["chat"] = {**manifest.chat.model_dump(), "assistant_tokens": {s: writers[s].assistant_tokens
                                                                               for s in SPLITS},
                           **{k: skipped[k] for k in ("no_assistant", "truncated", "dropped")}}
    return summary
