"""Benchmark: what the token scan (tasks/warm/tokens.py) adds to a warm, which hashes every byte anyway.

Lays out a local uint16 dataset (default 4 x 64 MB + 64 x 1 MB train shards and a held-out shard, about
330 MB) and warms it into a fresh cache, with the scan and with the scan replaced by one that does nothing
(here, in the bench, never in the product), in alternating order for several rounds; then the same for the
local re-hash (`verify=True` on a full cache: read, hash and scan, nothing fetched). Prints the medians of
wall time and of this process's CPU seconds per mode, and the ratios scan / no scan.

    .venv/bin/python bench/warm_tokens.py
    .venv/bin/python bench/warm_tokens.py --large 8 --large-mb 64 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import tasks.warm.tokens as tokens
from tasks.dataset_format import shard_key
from tasks.warm.core import warm
from tasks.warm.tokens import ShardRules


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


def timed(fn: Any) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


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
        times: dict[str, list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for scan in ((real_scan, NoScan) if r % 2 == 0 else (NoScan, real_scan)):
                name = "scan" if scan is real_scan else "no scan"
                tokens.TokenScan = scan  # ShardCheck.scan() builds the one named here
                cache = Path(tmp) / f"cache-{r}-{name}"
                try:
                    os.sync()
                    times.setdefault(f"cold warm, {name}", []).append(timed(lambda c=cache: warm(
                        str(src), c, progress=False, rules=rules, max_workers=args.workers)))
                    times.setdefault(f"local re-hash, {name}", []).append(timed(lambda c=cache: warm(
                        str(src), c, progress=False, rules=rules, max_workers=args.workers, verify=True)))
                finally:
                    tokens.TokenScan = real_scan
                    shutil.rmtree(cache, ignore_errors=True)
    print(f"{total / 1e6:.0f} MB, {args.large} x {args.large_mb} MB + {args.small} x 1 MB + 8 MB, "
          f"{args.rounds} rounds, medians")
    for what in ("cold warm", "local re-hash"):
        rows = {name: (statistics.median(t[0] for t in times[f"{what}, {name}"]),
                       statistics.median(t[1] for t in times[f"{what}, {name}"])) for name in ("no scan", "scan")}
        for name, (wall, cpu) in rows.items():
            print(f"  {what:<14} {name:<8} wall {wall:6.2f} s ({total / 1e6 / wall:6.0f} MB/s)  cpu {cpu:6.2f} s")
        print(f"  {what:<14} scan / no scan: wall {rows['scan'][0] / rows['no scan'][0]:.3f}, "
              f"cpu {rows['scan'][1] / rows['no scan'][1]:.3f}")


if __name__ == "__main__":
    main()
