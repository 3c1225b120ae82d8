"""The ranks' environment: torch's CPU allocator backs a rank's large host tensors with transparent huge pages
(one page fault per 2 MiB on first touch, not per 4 KiB), unless the caller turns it off; glibc's mmap threshold is
fixed (issue 38), unless the caller sets its own; ssh carries both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.launch import torchrun

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TOUCH_64_MIB = """
import torch
x = torch.ones(16 << 20)  # 64 MiB, first-touched
rollup = open("/proc/self/smaps_rollup").read()
print(int(rollup.split("AnonHugePages:")[1].split()[0]) * 1024)
"""


def _huge_bytes(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", TOUCH_64_MIB], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_ranks_large_tensors_sit_on_huge_pages_unless_the_caller_says_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = torchrun.rank_env()
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert torchrun.portable_env(env)["THP_MEM_ALLOC_ENABLE"] == "1"  # what ssh sends to the other hosts
    # The kernel decides whether madvise'd memory gets huge pages ("[never]" turns them off for everyone).
    if "[never]" not in THP_MODE.read_text():
        assert _huge_bytes(env) >= 32 << 20

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    off = torchrun.rank_env()
    assert off["THP_MEM_ALLOC_ENABLE"] == "0"
    if "[always]" not in THP_MODE.read_text():  # "always" gives huge pages whatever torch asks
        assert _huge_bytes(off) == 0


def test_a_ranks_large_blocks_go_back_to_the_kernel_unless_the_caller_tunes_glibc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = torchrun.rank_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(2 << 20)
    assert torchrun.portable_env(env)["MALLOC_MMAP_THRESHOLD_"] == str(2 << 20)
    # Evaluation ranks: the same blocks every window, served from the heap again, its top kept up to 64 MiB.
    scoring = torchrun.rank_env(evaluation=True)
    assert scoring["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and scoring["MALLOC_TRIM_THRESHOLD_"] == str(64 << 20)
    assert scoring["OMP_NUM_THREADS"] == env["OMP_NUM_THREADS"] and "MALLOC_TRIM_THRESHOLD_" not in env
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    tuned = torchrun.portable_env(torchrun.rank_env())
    assert tuned["MALLOC_MMAP_THRESHOLD_"] == str(4 << 20) and tuned["MALLOC_ARENA_MAX"] == "2"


def test_a_rank_waits_for_rank_0s_rendezvous_store_then_joins_it_and_never_waits_past_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 reaching the rendezvous first waits for rank 0's store to listen (torch's own client would back off
    for half a second), the probe leaves the store serving the real client; rank 0 never waits, and a store
    that never comes is left to torch's connect after the bound."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from tasks.train.rank import wait_for_rendezvous_store
    from tests.services import free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    wait_for_rendezvous_store(timeout_s=3600)  # rank 0 hosts the store: returns at once, nothing listens yet
    monkeypatch.setenv("RANK", "1")
    wait_for_rendezvous_store(timeout_s=0.05)  # nothing listens: returns after its bound

    waiter = threading.Thread(target=wait_for_rendezvous_store, args=(3600,), daemon=True)
    waiter.start()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    client.set("joined", "rank 1")
    assert master.get("joined") == b"rank 1"
