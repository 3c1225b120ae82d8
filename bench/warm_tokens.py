"""Benchmark: what the token scan (tasks/data/tokens.py) adds to a warm, which hashes every byte anyway.

Lays out a local uint16 dataset (default 4 x 64 MB + 64 x 1 MB train shards and a held-out shard, about
330 MB) and warms it into a fresh cache, with the scan and with the scan replaced by one that does nothing
(here, in the bench, never in the product); then the same for the local re-hash (`verify=True` on a full
cache: read, hash and scan, nothing fetched). Both modes in this process with the same `--workers` threads.
Each pair by bench/fair.py's method: in turn, the order rotated each round, `--rounds` (>= 3) samples a mode,
medians with min, max and the load at each sample, a set spread by more than 1.5x taken again. Prints the
medians of wall time and of this process's CPU seconds per mode, and the ratios scan / no scan.

    .venv/bin/python bench/warm_tokens.py
    .venv/bin/python bench/warm_tokens.py --large 8 --large-mb 64 --rounds 5

Run from the repository root with it on PYTHONPATH (as the tests are).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fair import Sample, alternated, median, stats, timed

import tasks.data.tokens as tokens
from tasks.base.dataset_format import shard_key
from tasks.data.tokens import ShardRules
from tasks.data.warm import warm


class NoScan(tokens.TokenScan):
    """The baseline: a warm whose scan finds nothing (the ids then pass any vocabulary)."""

    def update(self, data: Any) -> None:
        pass

    def result(self) -> tokens.Tokens:
        return tokens.Tokens(None, None)


def lay_out(root: Path, large: int, large_mb: int, small: int) -> None:
    rng = np.random.default_rng(0)
    files = {shard_key("train", i): (large_mb << 20) for i in range(large)}
    files |= {f"train/small-{i:04d}.bin": 1 << 20 for i in range(small)}
    files[shard_key("heldout", 0)] = 8 << 20
    entries = []
    for key, size in files.items():
        data = rng.integers(0, 32000, size // 2, dtype="<u2").tobytes()
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        entries.append({"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (root / "manifest.json").write_text(json.dumps({"format": "retrainer-dataset/1", "name": "bench",
                                                    "dtype": "uint16", "vocab_size": 32000, "files": entries}))


def with_scan(scan: type[tokens.TokenScan], fn: Callable[[], object], reset: Callable[[], object]
              ) -> Callable[[], Sample]:
    """A side: `fn` timed with `scan` as the warm's token scan (ShardCheck.scan() builds the one named in
    tasks.data.tokens), after `reset` untimed."""
    def run() -> Sample:
        real = tokens.TokenScan
        tokens.TokenScan = scan
        try:
            return timed(fn, reset)
        finally:
            tokens.TokenScan = real

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", type=int, default=4)
    parser.add_argument("--large-mb", type=int, default=64)
    parser.add_argument("--small", type=int, default=64, help="1 MB shards")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    rules = ShardRules(vocab_size=32000, splits=("train", "heldout"), field="bench")
    real_scan = tokens.TokenScan
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        src = Path(tmp) / "src"
        lay_out(src, args.large, args.large_mb, args.small)
        total = sum(p.stat().st_size for p in src.rglob("*.bin"))
        cache = Path(tmp) / "cache"

        def cold() -> None:
            warm(str(src), cache, progress=False, rules=rules, max_workers=args.workers)

        def rehash() -> None:
            warm(str(src), cache, progress=False, rules=rules, max_workers=args.workers, verify=True)

        def fresh() -> None:  # untimed: an empty cache, no dirty pages left to whoever comes next
            shutil.rmtree(cache, ignore_errors=True)
            os.sync()

        times = {"cold warm": alternated("cold warm", {"scan": with_scan(real_scan, cold, fresh),
                                                       "no scan": with_scan(NoScan, cold, fresh)}, args.rounds)}
        fresh()
        cold()  # the full cache every re-hash reads
        times["local re-hash"] = alternated("local re-hash", {"scan": with_scan(real_scan, rehash, os.sync),
                                                              "no scan": with_scan(NoScan, rehash, os.sync)},
                                            args.rounds)
    print(f"{total / 1e6:.0f} MB, {args.large} x {args.large_mb} MB + {args.small} x 1 MB + 8 MB, "
          f"{len(times['cold warm']['scan'])} rounds, medians")
    for what, got in times.items():
        for name in ("no scan", "scan"):
            wall = median(got[name])
            print(f"  {what:<14} {name:<8} wall {stats(got[name])} ({total / 1e6 / wall:6.0f} MB/s)  "
                  f"cpu {stats(got[name], what='cpu_s', load=False)}")
        print(f"  {what:<14} scan / no scan: wall {median(got['scan']) / median(got['no scan']):.3f}, "
              f"cpu {median(got['scan'], 'cpu_s') / median(got['no scan'], 'cpu_s'):.3f}")


if __name__ == "__main__":
    main()
