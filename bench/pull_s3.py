"""Benchmark: `retrainer registry pull` of a tree version from S3 vs `s5cmd cp`, `aws s3 cp --recursive`, s3fs.

What a serving node (or a training node warming production's weights) does: fetch a published model tree
from the object store onto local disk, every byte verified. A local S3 server (`rclone serve s3`,
disk-backed, pinned to --server-cpus) holds a tree of a few large shards put there by our store; each
tool copies it into a fresh destination, pinned to --client-cpus, rounds in rotated order; the page cache
is synced between runs. Ours is the whole CLI process (registry lookup in SQLite, every file hashed and
checked against the manifest, fsynced); the peers copy without verifying. Prints each tool's median wall
time and ours / the fastest peer's.

    .venv/bin/python bench/pull_s3.py [--shards 4] [--shard-mb 150] [--rounds 5]
Peers come from bench/warm.py's venv (/tmp/warm-peers-venv, created on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.warm import KEY, SECRET, ensure_peers, start_server, stop_server  # noqa: E402

BUCKET = "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--client-cpus", default="1")
    ap.add_argument("--peers-venv", type=Path, default=Path("/tmp/warm-peers-venv"))
    args = ap.parse_args()

    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    peers = ensure_peers(args.peers_venv)
    with tempfile.TemporaryDirectory(prefix="bench-pull-s3-", dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Path(tmp)
        (work / "server" / BUCKET).mkdir(parents=True)
        url, server, _ = start_server("rclone", peers, work / "server", args.server_cpus)
        try:
            opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": url}}
            src = work / "src"
            src.mkdir()
            for i in range(args.shards):
                with open(src / f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors", "wb") as fh:
                    for _ in range(args.shard_mb):
                        fh.write(os.urandom(1 << 20))
            (src / "config.json").write_text('{"model_type": "llama"}')
            store = ArtifactStore(f"s3://{BUCKET}/store", opts)
            ref = store.put_tree(src)
            db = f"sqlite:///{work / 'registry.db'}"
            upgrade(db)
            with Registry(db) as reg:
                rec = reg.publish_version("bench", ref, Lineage("cfg", "data", "rev", "bench"), {"loss": 1.0}, "b")
                reg.switch_alias("bench", "production", rec.version, actor="bench", reason="bench", action="publish")
            tree = f"s3://{BUCKET}/store/trees/{ref.digest[:2]}/{ref.digest}"
            env = dict(os.environ, OMP_NUM_THREADS="1", AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                       AWS_DEFAULT_REGION="us-east-1")
            fsget = ("import json, sys, s3fs; fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]));"
                     f"fs.get('{tree.removeprefix('s3://')}/', sys.argv[2], recursive=True)")
            tools = {
                "retrainer registry pull": lambda d: [sys.executable, "-m", "tasks.cli", "registry", "pull",
                                                      "--model", "bench", "--db", db, "--storage-options",
                                                      json.dumps(opts), str(d)],
                "s5cmd cp": lambda d: [str(peers["s5cmd"]), "--log", "error", "--endpoint-url", url, "cp",
                                       f"{tree}/*", f"{d}/"],
                "aws s3 cp": lambda d: [str(peers["aws"]), "s3", "cp", "--recursive", tree, str(d), "--endpoint-url",
                                        url, "--only-show-errors"],
                "s3fs fs.get": lambda d: [sys.executable, "-c", fsget, json.dumps(opts), str(d)],
            }
            walls: dict[str, list[float]] = {name: [] for name in tools}
            names = list(tools)
            print(f"tree: {args.shards} x {args.shard_mb} MB + config.json ({ref.size / 1e6:.0f} MB); server on CPU "
                  f"{args.server_cpus}, clients on CPU {args.client_cpus}; load {os.getloadavg()[0]:.2f}", flush=True)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    dest = work / "dest"
                    subprocess.run(["sync"], check=True)
                    started = time.perf_counter()
                    subprocess.run(["taskset", "-c", args.client_cpus, *tools[name](dest)], check=True, env=env,
                                   cwd=ROOT, capture_output=True)
                    subprocess.run(["sync"], check=True)  # the peers do not fsync: theirs is paid here, in the time
                    walls[name].append(time.perf_counter() - started)
                    got = sorted(p.name for p in dest.iterdir() if p.name != "manifest.json")  # peers copy it too
                    if got != sorted(p.name for p in src.iterdir()):
                        raise SystemExit(f"{name}: copied {got}")
                    shutil.rmtree(dest)
            ours = statistics.median(walls["retrainer registry pull"])
            best = min(statistics.median(w) for n, w in walls.items() if n != "retrainer registry pull")
            for name, w in walls.items():
                med = statistics.median(w)
                print(f"{name:<24} {med:6.2f} s ({ref.size / 1e6 / med:5.0f} MB/s)  runs {[round(x, 2) for x in w]}")
            print(f"fastest peer / ours: {best / ours:.2f}")
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()
