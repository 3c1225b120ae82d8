"""`retrainer warm CONFIG` and `retrainer warm-url SOURCE CACHE`: print the dataset dir and the report."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tasks.base.errors import InvalidInputError


def _print(result: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    r = result.report
    print(result.dataset_dir)
    print(f"manifest {result.manifest_hash}: {r.files_total} files, {r.bytes_total / 1e6:.1f} MB; "
          f"fetched {r.files_fetched} ({r.bytes_fetched / 1e6:.1f} MB), skipped {r.files_skipped}, "
          f"verified {r.files_verified}, retries {r.retries}, {r.seconds:.2f} s, {r.mb_per_s:.1f} MB/s")


def _cmd_warm(args: argparse.Namespace) -> int:
    from tasks.data.warm import warm_mixture
    from tasks.models.resolve import load_config

    cfg = load_config(args.config)
    results = warm_mixture(cfg, verify=args.verify, max_workers=args.workers, progress=not args.json)
    if args.json:  # the primary's result, with each replay source's under "replay"
        print(json.dumps({**results[0].to_dict(), "replay": [r.to_dict() for r in results[1:]]}, indent=2))
        return 0
    for result in results:
        _print(result, as_json=False)
    return 0


def _cmd_warm_url(args: argparse.Namespace) -> int:
    from tasks.data.warm import warm

    try:
        opts = json.loads(args.storage_options) if args.storage_options else None
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"--storage-options: not valid JSON: {exc}") from None
    result = warm(args.source_url, args.cache_root, manifest_key=args.manifest, storage_options=opts,
                  disk_budget_bytes=args.budget, verify=args.verify, max_workers=args.workers,
                  progress=not args.json)
    _print(result, args.json)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true", help="re-hash files already in the cache")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--workers", type=int, default=None, help="concurrent reads (default 16)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("warm", help="copy the config's dataset (and data.replay sources) to the local "
                                           "cache, verified")
    p.add_argument("config")
    _common(p)
    p.set_defaults(handler=_cmd_warm)

    u = subparsers.add_parser("warm-url", help="warm a dataset given by URL into a cache root")
    u.add_argument("source_url")
    u.add_argument("cache_root")
    u.add_argument("--manifest", default="manifest.json", help="manifest key under the source URL")
    u.add_argument("--budget", type=int, default=None, help="disk budget of the cache root in bytes")
    u.add_argument("--storage-options", help="fsspec storage options as JSON")
    _common(u)
    u.set_defaults(handler=_cmd_warm_url)
