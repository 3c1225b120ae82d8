"""The dataset verbs: `retrainer make-data CONFIG` (a synthetic or given-text dataset where the config's data goes,
tasks/data/synthetic.py), `retrainer manifest URL` (hash a prefix's objects into its manifest) and
`retrainer prepare-data INPUT... --tokenizer T --dest D` (tokenize a corpus, tasks/data/prepare/)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tasks.base.dataset_format import MANIFEST_KEY
from tasks.base.errors import InvalidInputError


def _cmd_make_data(args: argparse.Namespace) -> int:
    from tasks.data.manifest import claim_destination, prefix_fs
    from tasks.data.synthetic import make_data
    from tasks.models.resolve import load_config

    cfg = load_config(args.config)
    dest = args.dest or cfg.data.source_url
    claim_destination(*prefix_fs(dest, cfg.data.storage_options), dest, overwrite=args.overwrite)
    manifest = make_data(
        dest, name=cfg.name, n_train_shards=args.shards, n_heldout_shards=args.heldout_shards,
        tokens_per_shard=args.tokens_per_shard, seed=args.seed if args.seed is not None else cfg.train.seed,
        text_files=args.text, storage_options=cfg.data.storage_options,
    )
    print(json.dumps({"dest": dest, "files": len(manifest.files), "bytes": manifest.total_bytes,
                      "manifest_hash": manifest.hash}, indent=2))
    return 0


def _cmd_manifest(args: argparse.Namespace) -> int:
    from tasks.data.manifest import build_manifest

    opts = json.loads(args.storage_options) if args.storage_options else None
    manifest = build_manifest(args.url, output_key=args.output, name=args.name, storage_options=opts)
    print(json.dumps({"url": args.url, "files": len(manifest.files), "bytes": manifest.total_bytes,
                      "manifest_hash": manifest.hash}, indent=2))
    return 0


def _cmd_prepare_data(args: argparse.Namespace) -> int:
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
        chat=args.chat, messages_field=args.messages_field, seq_len=args.seq_len, overlong=args.overlong,
    ))
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("make-data", help="write a deterministic synthetic (or given-text) token dataset")
    p.add_argument("config")
    p.add_argument("--dest", help="dataset URL (default: the config's data.source_url)")
    p.add_argument("--shards", type=int, default=4, help="train shards (default 4)")
    p.add_argument("--heldout-shards", type=int, default=1)
    p.add_argument("--tokens-per-shard", type=int, default=65536)
    p.add_argument("--seed", type=int, default=None, help="default: the config's train.seed")
    p.add_argument("--text", nargs="+", metavar="FILE", help="byte-tokenize these local text files instead")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at the destination")
    p.set_defaults(handler=_cmd_make_data)

    m = subparsers.add_parser("manifest", help="hash every object under a prefix and write its manifest")
    m.add_argument("url")
    m.add_argument("--output", default=MANIFEST_KEY, help="manifest key under the prefix")
    m.add_argument("--name", help="dataset name (default: last prefix segment)")
    m.add_argument("--storage-options", help="fsspec storage options as JSON")
    m.set_defaults(handler=_cmd_manifest)

    p = subparsers.add_parser(
        "prepare-data", help="tokenize JSONL / Parquet / text files with a Hugging Face tokenizer into a dataset",
        description="Tokenize a corpus into token shards + manifest.json (EOS after every document, held-out "
                    "split by document hash). Plain text: one document per blank-line-separated block. --chat: "
                    "conversations rendered with the model's chat template, with a loss mask of the assistant's "
                    "tokens and each conversation's start beside every shard.",
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
    p.add_argument("--chat", action="store_true",
                   help="rows are conversations (OpenAI-style messages) rendered with the tokenizer directory's chat "
                        "template; the loss trains on the assistant's tokens only")
    p.add_argument("--messages-field", default="messages",
                   help="--chat: JSONL field / Parquet column holding a row's messages (default: messages)")
    p.add_argument("--seq-len", type=int, help="--chat: the training window; a longer conversation is --overlong")
    p.add_argument("--overlong", metavar="RULE",
                   help="--chat: truncate (cut a conversation longer than --seq-len to its first tokens) or drop (it)")
    p.set_defaults(handler=_cmd_prepare_data)
