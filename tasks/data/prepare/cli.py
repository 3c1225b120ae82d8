"""The `prepare-data` verb. Light at import: tokenizers and pyarrow load only when the verb runs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tasks.base.errors import InvalidInputError


def _cmd(args: argparse.Namespace) -> int:
    # lazy: a verb loads only what it runs (retrainer --help stays instant)
    from tasks.data.prepare.core import PrepareOptions, default_workers, prepare

    try:
        opts = json.loads(args.storage_options) if args.storage_options else None
    except ValueError as exc:
        raise InvalidInputError(f"--storage-options: not valid JSON: {exc}") from None
    summary = prepare(PrepareOptions(
        inputs=args.inputs, tokenizer=args.tokenizer, dest=args.dest, fmt=args.format, text_field=args.text_field,
        column=args.column, eos_token=args.eos_token, heldout_fraction=args.heldout_fraction,
        tokens_per_shard=args.tokens_per_shard, workers=default_workers() if args.workers is None else args.workers,
        max_bad_fraction=args.max_bad_fraction, name=args.name, storage_options=opts, overwrite=args.overwrite,
    ))
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prepare-data", help="tokenize JSONL / Parquet / text files with a Hugging Face tokenizer into a dataset",
        description="Tokenize a corpus into token shards + manifest.json (EOS after every document, held-out "
                    "split by document hash). Plain text: one document per blank-line-separated block.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, globs, directories or fsspec URLs (s3://...): .jsonl/.json/.ndjson, "
                        ".parquet/.pq, .txt/.text/.md")
    p.add_argument("--tokenizer", required=True, help="model directory holding tokenizer.json, or a tokenizer.json")
    p.add_argument("--dest", required=True, help="dataset directory or fsspec URL to write")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "parquet", "text"],
                   help="input format (default: from each file's suffix)")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--column", default="text", help="Parquet column holding the text (default: text)")
    p.add_argument("--eos-token", help="EOS token (default: eos_token of the tokenizer's tokenizer_config.json "
                                       "or special_tokens_map.json)")
    p.add_argument("--heldout-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    p.add_argument("--tokens-per-shard", type=int, default=1 << 26, help="default 67108864")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the cores available)")
    p.add_argument("--max-bad-fraction", type=float, default=0.01,
                   help="fail (exit 2) when a file has a larger share of bad rows (default 0.01)")
    p.add_argument("--name", help="dataset name (default: last segment of --dest)")
    p.add_argument("--storage-options", help="fsspec storage options as JSON (inputs and destination)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at --dest")
    p.set_defaults(handler=_cmd)
