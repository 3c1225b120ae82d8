"""32 concurrent publisher/rollback processes on PostgreSQL: no lost update, gap-free versions, one history chain."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue

from tasks.registry import ArtifactRef, Lineage, Registry, upgrade
from tests.registry import concurrency_worker as w

WORKERS = 32
OPS = 3


def test_32_processes_publish_switch_and_rollback(pg_url: str) -> None:
    upgrade(pg_url)
    with Registry(pg_url) as reg:  # seed: v1 live, so rollbacks have something to work on
        seed = reg.publish_version(w.MODEL, ArtifactRef("f" * 64, "file:///s/seed", 1), Lineage("c", "m", "r", "seed"),
                                   {}, "seed")
        reg.switch_alias(w.MODEL, w.ALIAS, seed.version, actor="seed", reason="seed")

    # Separate processes, each with its own connections. A forkserver with the worker module preloaded
    # forks them from one warm interpreter instead of 32 cold imports (the machine has 2 cores).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.registry.concurrency_worker"])
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=w.run, args=(pg_url, i, OPS, barrier, results)) for i in range(WORKERS)]
    for p in procs:
        p.start()
    outs = []
    try:
        for _ in procs:
            outs.append(results.get(timeout=240))
    except queue.Empty:
        raise AssertionError(f"only {len(outs)} of {WORKERS} workers reported") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [o["error"] for o in outs if o["error"]]
    assert errors == []

    with Registry(pg_url) as reg:
        versions = [v.version for v in reg.list_versions(w.MODEL)]
        history = reg.history(w.MODEL, w.ALIAS)
        live = reg.live_version(w.MODEL, w.ALIAS)

    published = sorted(v for o in outs for v in o["published"])
    n_publishers = sum(1 for o in outs if o["role"] != "rollback")
    # Unique, gap-free version numbers: exactly one per publish call.
    assert published == list(range(2, 2 + n_publishers * OPS))
    assert versions == list(range(1, 2 + n_publishers * OPS))

    # The history is one chain with gap-free sequence numbers.
    assert [h.seq for h in history] == list(range(1, len(history) + 1))
    assert history[0].from_version is None
    for prev, row in itertools.pairwise(history):
        assert row.from_version == prev.to_version, (prev, row)
        assert row.from_version != row.to_version

    # No lost update: every acknowledged switch is in the history exactly as reported, and nothing else is.
    acked = {s["seq"]: (s["from_version"], s["to_version"], s["actor"], s["action"])
             for o in outs for s in o["switches"]}
    assert len(acked) == sum(len(o["switches"]) for o in outs)  # no two switches got the same seq
    assert acked == {h.seq: (h.from_version, h.to_version, h.actor, h.action) for h in history[1:]}
    assert sum(1 for o in outs if o["role"] == "rollback" for _ in o["switches"]) > 0

    # Compare-and-swap switches started exactly from the version they expected.
    cas = [(exp, rec) for o in outs for exp, rec in o["cas"]]
    assert len(cas) == (WORKERS // 4) * OPS
    assert all(rec["from_version"] == exp for exp, rec in cas)

    # The final pointer equals the last history row.
    assert live is not None and live.version == history[-1].to_version


def test_32_threads_share_one_registry_and_its_bounded_pool(pg_url: str) -> None:
    """Threads beyond the pool (4 connections) queue in-process; every switch still lands once, in one chain."""
    import threading

    from tasks.registry.db import PG_POOL_SIZE

    upgrade(pg_url)
    threads_n, per_thread = 32, 5
    with Registry(pg_url) as reg:
        assert reg.engine.pool.size() == PG_POOL_SIZE
        for i in range(3):
            reg.publish_version("shared", ArtifactRef(f"{i:064x}", f"file:///s/{i}", 1), Lineage("c", "m", "r", "t"),
                                {}, "seed")
        acked: list[int] = []
        errors: list[BaseException] = []
        start = threading.Barrier(threads_n)

        def work(n: int) -> None:
            try:
                start.wait()
                for k in range(per_thread):
                    rec = reg.switch_alias("shared", "production", 1 + (n + k) % 3, actor=f"t{n}", reason="pool")
                    if rec.changed:
                        acked.append(rec.seq)
            except BaseException as exc:  # reported below, not swallowed
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(n,)) for n in range(threads_n)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert errors == []
        assert reg.engine.pool.checkedout() == 0
        history = reg.history("shared", "production")
    assert sorted(acked) == [h.seq for h in history]
    for prev, row in itertools.pairwise(history):
        assert row.from_version == prev.to_version
