"""Benchmark: `retrainer registry pull` of a tree from S3 vs `s5cmd cp`, `aws s3 cp --recursive`, s3fs.

What a serving node (or a training node warming production's weights) does: fetch a published model tree
from the object store onto local disk, every byte verified. A local S3 server (`--server rclone`: `rclone serve
s3`, disk-backed, which answers a ranged GET with the whole object; `--server moto`: moto's server in this
process, which honours ranges), pinned to --server-cpus with this process, holds a tree of a few large shards
and a few small json files put there by our store; each tool copies it into a fresh destination, pinned to
--client-cpus; the page cache is synced before and after each run (the peers do not fsync: theirs is paid
there, in the time). Ours is the whole CLI process (registry lookup in SQLite, every file hashed and checked
against the manifest, fsynced); the peers copy without verifying. Whether the server honours a ranged GET is
probed first and printed.

Sampling: bench/fair.py's method, --rounds (>= 3) runs of each tool, the order rotated each round; each tool's
median, min, max and the 1-minute load average at the start of each run are printed; a set where any tool's
runs spread by more than 1.5x is taken again (twice at most), not averaged; a set still scattered is flagged.
Prints ours / s5cmd (goal >= 0.7: s5cmd's time / ours) and ours / the fastest peer.

    .venv/bin/python bench/pull_s3.py [--server rclone|moto] [--shards 6] [--shard-mb 150] [--rounds 3]
Peers come from bench/warm.py's venv (/tmp/warm-peers-venv, created on first use).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fair import Sample, alternated, median, stats  # noqa: E402

from bench.warm import BUCKET, KEY, SECRET, check_cpus, ensure_peers, start_server, stop_server  # noqa: E402

OURS = "retrainer registry pull"
GOAL = 0.7  # s5cmd's time / ours


def write_tree(src: Path, shards: int, shard_mb: int) -> None:
    """A model-like folder: `shards` safetensors-like files of random bytes, an index and a few small json."""
    src.mkdir()
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for name in names:
        with open(src / name, "wb") as fh:
            for _ in range(shard_mb):
                fh.write(os.urandom(1 << 20))
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "generation_config.json").write_text('{"do_sample": false}')
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": n for i, n in
                                                                                 enumerate(names)}}))
    (src / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(50_000)}}))


def ranges_honoured(url: str, key: str) -> str:
    """Ask the server for 10 bytes of `key` (obstore, as ours reads): does it answer 206 or the whole object?"""
    from tasks.base.object_source import RangeUnsupportedError, open_source

    source = open_source(f"s3://{BUCKET}", {"key": KEY, "secret": SECRET, "endpoint_url": url}, 1)
    try:
        got = source.read_range(key, 0, 10)
    except RangeUnsupportedError as exc:
        return f"no: a ranged GET is answered with the whole object ({exc})"
    return f"yes ({len(got)} bytes for bytes=0-9)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=["rclone", "moto"], default="rclone")
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--shard-mb", type=int, default=150,
                    help="MiB a shard; above 150 `rclone serve s3` fails our commit (no ETag in its UploadPartCopy)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-cpus", default="0", help="taskset -c list for the S3 server (and this process)")
    ap.add_argument("--client-cpus", default="1", help="taskset -c list for every client run")
    ap.add_argument("--peers-venv", type=Path, default=Path("/tmp/warm-peers-venv"))
    args = ap.parse_args()
    rounds = max(3, args.rounds)

    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: no line per request
    server_cpus, _ = check_cpus(args.server_cpus, args.client_cpus)
    os.sched_setaffinity(0, server_cpus)  # moto serves from this process's threads; rclone is pinned there too
    peers = ensure_peers(args.peers_venv)
    with tempfile.TemporaryDirectory(prefix="bench-pull-s3-", dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Path(tmp)
        (work / "server" / BUCKET).mkdir(parents=True)
        url, server, _ = start_server(args.server, peers, work / "server", args.server_cpus)
        try:
            opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": url}}
            src = work / "src"
            write_tree(src, args.shards, args.shard_mb)
            store = ArtifactStore(f"s3://{BUCKET}/store", opts)
            ref = store.put_tree(src)
            db = f"sqlite:///{work / 'registry.db'}"
            upgrade(db)
            with Registry(db) as reg:
                rec = reg.publish_version("bench", ref, Lineage("cfg", "data", "rev", "bench"), {"loss": 1.0}, "b")
                reg.switch_alias("bench", "production", rec.version, actor="bench", reason="bench", action="publish")
            tree = f"s3://{BUCKET}/store/trees/{ref.digest[:2]}/{ref.digest}"
            # aws and s3fs would check each object's stored CRC against what they got, and the CRC the server
            # keeps for an object our store put in parts (then copied) is the parts' combination, not the
            # whole object's: they refuse the download. Only where the operation requires it, then.
            env = dict(os.environ, OMP_NUM_THREADS="1", AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                       AWS_DEFAULT_REGION="us-east-1", AWS_RESPONSE_CHECKSUM_VALIDATION="when_required")
            fsget = ("import json, sys, s3fs; fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]));"
                     f"fs.get('{tree.removeprefix('s3://')}/', sys.argv[2], recursive=True)")
            tools: dict[str, Callable[[Path], list[str]]] = {
                OURS: lambda d: [sys.executable, "-m", "tasks.cli", "registry", "pull", "--model", "bench", "--db", db,
                                 "--storage-options", json.dumps(opts), str(d)],
                "s5cmd cp": lambda d: [str(peers["s5cmd"]), "--log", "error", "--endpoint-url", url, "cp",
                                       f"{tree}/*", f"{d}/"],
                "aws s3 cp": lambda d: [str(peers["aws"]), "s3", "cp", "--recursive", tree, str(d), "--endpoint-url",
                                        url, "--only-show-errors"],
                "s3fs fs.get": lambda d: [sys.executable, "-c", fsget, json.dumps(opts), str(d)],
            }
            want = sorted(p.name for p in src.iterdir())

            def run(name: str) -> Sample:
                dest = work / "dest"
                subprocess.run(["sync"], check=True)
                load = os.getloadavg()[0]
                started = time.perf_counter()
                done = subprocess.run(["taskset", "-c", args.client_cpus, *tools[name](dest)], env=env, cwd=ROOT,
                                      capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
                subprocess.run(["sync"], check=True)  # the peers do not fsync: theirs is paid here, in the time
                wall = time.perf_counter() - started
                got = sorted(p.name for p in dest.iterdir() if p.name != "manifest.json")  # peers copy it too
                if got != want:
                    raise SystemExit(f"{name}: copied {got}")
                shutil.rmtree(dest)
                return Sample(wall, load)

            shard = f"store/trees/{ref.digest[:2]}/{ref.digest}/{next(n for n in want if n.endswith('.safetensors'))}"
            print(f"server: {args.server} on CPU {args.server_cpus}; ranged GETs honoured: "
                  f"{ranges_honoured(url, shard)}", flush=True)
            print(f"tree: {args.shards} x {args.shard_mb} MB + 4 json ({ref.size / 1e6:.0f} MB); clients on CPU "
                  f"{args.client_cpus}; load {os.getloadavg()[0]:.2f}", flush=True)
            run(OURS)  # untimed: the first copy after the server starts is slower, whoever makes it
            samples = alternated("pull", {name: lambda name=name: run(name) for name in tools}, rounds)
            for name, got in samples.items():
                print(f"{name:<24} {stats(got)} {ref.size / 1e6 / median(got):5.0f} MB/s", flush=True)
            ours = median(samples[OURS])
            best = min((median(s), n) for n, s in samples.items() if n != OURS)
            print(f"s5cmd / ours: {median(samples['s5cmd cp']) / ours:.2f} (goal >= {GOAL}); fastest peer "
                  f"({best[1]}) / ours: {best[0] / ours:.2f}", flush=True)
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()
