"""Benchmark: alias switches/s and p50/p99 latency, ours vs MLflow's model registry, same PostgreSQL.

Usage: .venv/bin/python bench/registry.py [--pg postgresql://postgres@127.0.0.1:5432] [--seconds 3]
MLflow runs from its own venv (default /tmp/mlflow-venv; created with pip if missing) so its pins
never touch ours. Each system gets a scratch database; W writer threads (own connections) switch
an alias between existing versions for a fixed time. Ours appends a history row per switch (on
PostgreSQL one call of `registry_move_alias`, migration 0002). The load average is printed
because the numbers mean little without it on a shared machine.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WRITERS = (1, 8, 32)
VERSIONS = 20

MLFLOW_SCRIPT = r'''
import json, random, sys, threading, time, logging
logging.disable(logging.WARNING)
from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore
url, seconds, writers_list, versions = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
store = SqlAlchemyStore(url)
store.create_registered_model("bench")
for i in range(versions):
    store.create_model_version("bench", f"file:///tmp/m{i}")
out = {}
for writers in writers_list:
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
    out[writers] = {"lat": lat, "elapsed": time.monotonic() - t0}
print(json.dumps(out))
'''


def _stats(lat: list[float], elapsed: float) -> dict[str, float]:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    return {"switches": len(lat), "per_s": len(lat) / elapsed, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


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


def bench_ours(url: str, seconds: float) -> dict[int, dict[str, float]]:
    import hashlib

    from tasks.registry import ANY, ArtifactRef, Lineage, Registry, upgrade
    from tasks.registry.db import make_engine

    upgrade(url)
    reg = Registry(url, engine=make_engine(url, pool_size=max(WRITERS) + 2))
    for i in range(VERSIONS):
        d = hashlib.sha256(str(i).encode()).hexdigest()
        reg.publish_version("bench", ArtifactRef(d, f"file:///tmp/{d}", i), Lineage("c", "m", "r", str(i)), {}, "b")
    results = {}
    for writers in WRITERS:
        lat: list[float] = []
        stop = time.monotonic() + seconds

        def work(lat: list[float] = lat, stop: float = stop) -> None:
            rnd, mine = random.Random(), []
            while time.monotonic() < stop:
                t = time.perf_counter()
                reg.switch_alias("bench", "production", rnd.randint(1, VERSIONS), expect=ANY, actor="bench",
                                 reason="bench")
                mine.append(time.perf_counter() - t)
            lat.extend(mine)

        threads = [threading.Thread(target=work) for _ in range(writers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results[writers] = _stats(lat, time.monotonic() - t0)
    hist = reg.history("bench", "production")
    assert all(b.from_version == a.to_version for a, b in itertools.pairwise(hist)), "history chain broken"
    reg.close()
    return results


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


def bench_mlflow(py: Path, url: str, seconds: float) -> dict[int, dict[str, float]]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(MLFLOW_SCRIPT)
    r = subprocess.run([str(py), fh.name, url, str(seconds), json.dumps(list(WRITERS)), str(VERSIONS)],
                       capture_output=True, text=True, timeout=1800)
    Path(fh.name).unlink()
    if r.returncode:
        raise RuntimeError(f"mlflow bench failed: {r.stderr[-2000:]}")
    raw = json.loads(r.stdout.strip().splitlines()[-1])
    return {int(k): _stats(v["lat"], v["elapsed"]) for k, v in raw.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mlflow-venv", type=Path, default=Path("/tmp/mlflow-venv"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    tag = uuid.uuid4().hex[:8]
    ours_db, ml_db = f"bench_reg_{tag}", f"bench_mlflow_{tag}"
    _create_db(args.pg, ours_db)
    try:
        ours = bench_ours(f"{args.pg.replace('postgresql://', 'postgresql+psycopg://')}/{ours_db}", args.seconds)
    finally:
        _drop_db(args.pg, ours_db)
    theirs: dict[int, dict[str, Any]] = {}
    py = mlflow_python(args.mlflow_venv)
    if py:
        _create_db(args.pg, ml_db)
        try:
            ml_url = f"{args.pg.replace('postgresql://', 'postgresql+psycopg2://')}/{ml_db}"
            theirs = bench_mlflow(py, ml_url, args.seconds)
        finally:
            _drop_db(args.pg, ml_db)
    cols = ("ours/s", "p50ms", "p99ms", "mlflow/s", "p50ms", "p99ms")
    print(f"{'writers':>7}  " + " ".join(f"{c:>8}" for c in cols) + "   ratio")
    for w in WRITERS:
        o, m = ours[w], theirs.get(w)
        line = f"{w:>7}  {o['per_s']:8.0f} {o['p50_ms']:8.2f} {o['p99_ms']:8.2f}"
        if m:
            line += f" {m['per_s']:8.0f} {m['p50_ms']:8.2f} {m['p99_ms']:8.2f}   {o['per_s'] / m['per_s']:5.2f}x"
        else:
            line += "   (mlflow not measured)"
        print(line)
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before: {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
          f"after: {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on {os.cpu_count()} CPUs")
    print(json.dumps({"ours": ours, "mlflow": theirs, "load_before": load_before, "load_after": load_after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
