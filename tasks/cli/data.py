"""`retrainer make-data CONFIG` (a synthetic or given-text dataset where the config's data goes) and
`retrainer manifest URL` (hash a prefix's objects into its manifest). The verbs live here, on top of the
graph: make-data reads a job config, resolved (tasks/models/resolve.py), which the data layer below cannot."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tasks.base.dataset_format import MANIFEST_KEY
from tasks.data.manifest import build_manifest, claim_destination
from tasks.data.synthetic import make_data


def _cmd_make_data(args: argparse.Namespace) -> int:
    import fsspec

    from tasks.models.resolve import (
        load_config,  # lazy: a verb loads only what it runs (retrainer --help stays instant)
    )

    cfg = load_config(args.config)
    dest = args.dest or cfg.data.source_url
    claim_destination(*fsspec.core.url_to_fs(dest, **cfg.data.storage_options), dest, overwrite=args.overwrite)
    manifest = make_data(
        dest, name=cfg.name, n_train_shards=args.shards, n_heldout_shards=args.heldout_shards,
        tokens_per_shard=args.tokens_per_shard, seed=args.seed if args.seed is not None else cfg.train.seed,
        text_files=args.text, storage_options=cfg.data.storage_options,
    )
    print(json.dumps({"dest": dest, "files": len(manifest.files), "bytes": manifest.total_bytes,
                      "manifest_hash": manifest.hash}, indent=2))
    return 0


def _cmd_manifest(args: argparse.Namespace) -> int:
    opts = json.loads(args.storage_options) if args.storage_options else None
    manifest = build_manifest(args.url, output_key=args.output, name=args.name, storage_options=opts)
    print(json.dumps({"url": args.url, "files": len(manifest.files), "bytes": manifest.total_bytes,
                      "manifest_hash": manifest.hash}, indent=2))
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
