"""Benchmark: alias switches/s and p50/p99 latency, ours vs MLflow's model registry, same PostgreSQL.

Usage: .venv/bin/python bench/registry.py [--pg postgresql://postgres@127.0.0.1:5432] [--seconds 2] [--rounds 3]
       [--pool-size N]   (our pool; default as shipped, 4 connections)
MLflow runs from its own venv (default /tmp/mlflow-venv; created with pip if missing) so its pins
never touch ours. Each system gets a scratch database; W writer threads (own connections) switch
an alias between existing versions for a fixed time (the same W threads on either side: the same
cores). Each point (W) by bench/fair.py's method: ours and MLflow in turn, the order rotated each
round, `--rounds` (>= 3) samples a side, a sample being one run's switches/s; the median printed with
min, max and the load at each sample, a set spread by more than 1.5x taken again (the rates are the
samples: a rate spread is a time spread).
Ours appends a history row per switch. Each switch is a plain promote (a person's `retrainer promote`
without --force): on PostgreSQL one call of `registry_move_alias` (migration 0002), which since
migration 0007 also applies the "rolled back from this alias needs force" rule itself, through a
partial index on the history's rollback rows (before 0007 a promote was a three-statement pipeline
whose guard scanned the alias's whole history, so it slowed down as the history grew). The load
average is printed: on a shared machine the numbers mean little without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fair import Sample, alternated, median, stats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WRITERS = (1, 8, 32)
VERSIONS = 20

MLFLOW_SCRIPT = r"""
import json, random, sys, threading, time, logging
logging.disable(logging.WARNING)
from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore
url, versions = sys.argv[1], int(sys.argv[2])
store = SqlAlchemyStore(url)
store.create_registered_model("bench")
for i in range(versions):
    store.create_model_version("bench", f"file:///tmp/m{i}")
print("ready", flush=True)
for line in sys.stdin:  # one request per line: "WRITERS SECONDS"; one JSON answer per line
    writers, seconds = int(line.split()[0]), float(line.split()[1])
    lat, stop = [], time.monotonic() + seconds
    def work():
        rnd, mine = random.Random(), []
        while time.monotonic() < stop:
            t = time.perf_counter()
            store.set_registered_model_alias("bench", "production", str(rnd.randint(1, versions)))
            mine.append(time.perf_counter() - t)
        lat.extend(mine)
    ts = [threading.Thread(target=work) for _ in range(writers)]
    t0 = time.monotonic()
    [t.start() for t in ts]; [t.join() for t in ts]
    print(json.dumps({"lat": lat, "elapsed": time.monotonic() - t0}), flush=True)
"""


def _rate(run: Any, writers: int, seconds: float) -> Sample:
    """One run of a point as a sample: its switches/s, the load when it started, its latencies (`extra["lat"]`)."""
    load = os.getloadavg()[0]
    lat, elapsed = run(writers, seconds)
    return Sample(len(lat) / elapsed, load, extra={"lat": lat})


def _stats(samples: list[Sample]) -> dict[str, Any]:
    """Throughput: median of the runs' rates; latency quantiles over every switch of every run."""
    lat = sorted(x for s in samples for x in s.extra["lat"])
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    return {"switches": len(lat), "per_s": median(samples), "per_s_rounds": [s.value for s in samples],
            "load_rounds": [s.load for s in samples], "per_s_stats": stats(samples, "/s", fmt=".0f"),
            "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


def _create_db(pg: str, name: str) -> None:
    import psycopg

    host = pg.split("://", 1)[1]
    user, hostport = host.split("@", 1)
    h, _, port = hostport.partition(":")
    with psycopg.connect(f"host={h} port={port or 5432} user={user} dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def _drop_db(pg: str, name: str) -> None:
    import psycopg

    host = pg.split("://", 1)[1]
    user, hostport = host.split("@", 1)
    h, _, port = hostport.partition(":")
    with psycopg.connect(f"host={h} port={port or 5432} user={user} dbname=postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Ours:
    """Our registry on a scratch database: 20 versions published, writer threads switch one alias."""

    def __init__(self, url: str, pool_size: int | None = None) -> None:
        import hashlib

        from tasks.registry import ArtifactRef, Lineage, Registry, upgrade
        from tasks.registry.db import make_engine

        upgrade(url)
        # Default: as shipped (tasks/registry/db.py's pool), as MLflow gets its own default pool.
        self.reg = Registry(url, engine=make_engine(url, pool_size=pool_size) if pool_size else None)
        for i in range(VERSIONS):
            d = hashlib.sha256(str(i).encode()).hexdigest()
            self.reg.publish_version("bench", ArtifactRef(d, f"file:///tmp/{d}", i), Lineage("c", "m", "r", str(i)),
                                     {}, "b")

    def run(self, writers: int, seconds: float) -> tuple[list[float], float]:
        from tasks.registry import ANY

        lat: list[float] = []
        stop = time.monotonic() + seconds

        def work() -> None:
            rnd, mine = random.Random(), []
            while time.monotonic() < stop:
                t = time.perf_counter()
                self.reg.switch_alias("bench", "production", rnd.randint(1, VERSIONS), expect=ANY, actor="bench",
                                      reason="bench")
                mine.append(time.perf_counter() - t)
            lat.extend(mine)

        threads = [threading.Thread(target=work) for _ in range(writers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return lat, time.monotonic() - t0

    def close(self) -> int:
        """Check the history chain (every switch recorded, each from = previous to); return its length."""
        hist = self.reg.history("bench", "production")
        assert all(b.from_version == a.to_version for a, b in itertools.pairwise(hist)), "history chain broken"
        self.reg.close()
        return len(hist)


class MLflow:
    """MLflow's SqlAlchemyStore in a long-lived subprocess of its own venv, driven one point at a time."""

    def __init__(self, py: Path, url: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
            fh.write(MLFLOW_SCRIPT)
        self.script = Path(fh.name)
        self.proc = subprocess.Popen([str(py), str(self.script), url, str(VERSIONS)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self._line() != "ready":
            raise RuntimeError("mlflow bench process did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mlflow bench process exited (rc={self.proc.wait()})")
        return line.strip()

    def run(self, writers: int, seconds: float) -> tuple[list[float], float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{writers} {seconds}\n")
        self.proc.stdin.flush()
        raw = json.loads(self._line())
        return raw["lat"], raw["elapsed"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.script.unlink(missing_ok=True)


def mlflow_python(venv: Path) -> Path | None:
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"installing mlflow into {venv} (separate venv) ...", file=sys.stderr)
        r = subprocess.run(f"{sys.executable} -m venv {venv} && {py} -m pip install -q mlflow psycopg2-binary",
                           shell=True, capture_output=True, text=True)
        if r.returncode:
            print(f"mlflow could not be installed: {r.stderr[-500:]}", file=sys.stderr)
            return None
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--seconds", type=float, default=2.0, help="per point and round")
    ap.add_argument("--rounds", type=int, default=3, help="samples a side and point (at least 3), alternated")
    ap.add_argument("--pool-size", type=int, default=None, help="our connection pool (default: as shipped)")
    ap.add_argument("--mlflow-venv", type=Path, default=Path("/tmp/mlflow-venv"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    tag = uuid.uuid4().hex[:8]
    ours_db, ml_db = f"bench_reg_{tag}", f"bench_mlflow_{tag}"
    py = mlflow_python(args.mlflow_venv)
    runs: dict[str, dict[int, list[Sample]]] = {"ours": {}, "mlflow": {}}
    _create_db(args.pg, ours_db)
    if py:
        _create_db(args.pg, ml_db)
    ours: Ours | None = None
    theirs: MLflow | None = None
    try:
        ours = Ours(f"{args.pg.replace('postgresql://', 'postgresql+psycopg://')}/{ours_db}", args.pool_size)
        if py:
            theirs = MLflow(py, f"{args.pg.replace('postgresql://', 'postgresql+psycopg2://')}/{ml_db}")
        for w in WRITERS:  # each point alternated, so that load from other work hits both sides alike
            sides = {"ours": lambda w=w: _rate(ours.run, w, args.seconds)}
            if theirs:
                sides["mlflow"] = lambda w=w: _rate(theirs.run, w, args.seconds)
            for name, samples in alternated(f"{w} writers", sides, args.rounds).items():
                runs[name][w] = samples
        recorded = ours.close()
        ours = None
    finally:
        if ours:
            ours.reg.close()
        if theirs:
            theirs.close()
        _drop_db(args.pg, ours_db)
        if py:
            _drop_db(args.pg, ml_db)
    result = {name: {w: _stats(r) for w, r in per.items() if r} for name, per in runs.items()}
    cols = ("ours/s", "p50ms", "p99ms", "mlflow/s", "p50ms", "p99ms")
    print(f"{'writers':>7}  " + " ".join(f"{c:>8}" for c in cols) + "   ratio")
    for w in WRITERS:
        o, m = result["ours"][w], result["mlflow"].get(w)
        line = f"{w:>7}  {o['per_s']:8.0f} {o['p50_ms']:8.2f} {o['p99_ms']:8.2f}"
        if m:
            line += f" {m['per_s']:8.0f} {m['p50_ms']:8.2f} {m['p99_ms']:8.2f}   {o['per_s'] / m['per_s']:5.2f}x"
        else:
            line += "   (mlflow not measured)"
        print(line)
    for w in WRITERS:
        print(f"{w:>7} writers, switches/s: ours {result['ours'][w]['per_s_stats']}"
              + (f" | mlflow {result['mlflow'][w]['per_s_stats']}" if w in result["mlflow"] else ""))
    load_after = os.getloadavg()
    print(f"{max(3, args.rounds)} alternated rounds x {args.seconds:g} s per point; switches/s = median of rounds; "
          f"ours recorded {recorded} history rows (chain checked)")
    print(f"load average (1/5/15 min) before: {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
          f"after: {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on {os.cpu_count()} CPUs")
    print(json.dumps({**result, "load_before": load_before, "load_after": load_after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
