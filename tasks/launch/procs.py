"""Find and stop every process of one launch, even those that escaped their process group.

Why a tag and not only a process group: a rank may start processes in a new session
(`start_new_session=True`), which `killpg` misses, and a process whose parent died
is re-parented to init where a tree walk cannot see it.
Every process a launcher starts carries `RETRAINER_LAUNCH_ID=<id>` in its
environment, which children inherit; `/proc/<pid>/environ` finds them all.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import psutil

log = logging.getLogger(__name__)

TAG_VAR = "RETRAINER_LAUNCH_ID"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged(tag: str, *, exclude: set[int] | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries this launch tag (zombies count as gone)."""
    needle = f"{TAG_VAR}={tag}".encode()
    skip = {os.getpid(), *(exclude or set())}
    found = []
    for pid in psutil.pids():
        if pid in skip:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tree(root_pid: int) -> list[psutil.Process]:
    """The process and all its current descendants that are still alive (an exited, unreaped root is not)."""
    try:
        root = psutil.Process(root_pid)
        return [p for p in (root, *root.children(recursive=True)) if _alive(p)]
    except psutil.Error:
        return []


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
            if sig == signal.SIGTERM:
                proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOPped, hung) rank must see its TERM
        except psutil.Error:
            continue


def stop_all(tag: str, *, root_pid: int | None = None, grace_s: float = 15.0, settle_s: float = 60.0,
             exclude: set[int] | None = None) -> int:
    """SIGTERM every process of the launch (tag + tree of root_pid), SIGKILL what is left after grace_s,
    and wait until none is left. Returns how many processes were signalled; raises if some survive."""

    def members() -> list[psutil.Process]:
        procs = {p.pid: p for p in tagged(tag, exclude=exclude)}
        if root_pid is not None:
            procs.update({p.pid: p for p in tree(root_pid) if p.pid not in (exclude or set())})
        return list(procs.values())

    first = members()
    if not first:
        return 0
    log.info("stopping %d process(es) of launch %s", len(first), tag[:8])
    _signal(first, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        live = members()
        if not live:
            return len(first)
        _signal([p for p in live if p.pid not in {q.pid for q in first}], signal.SIGTERM)
        time.sleep(0.2)
    deadline = time.monotonic() + settle_s
    while (live := members()) and time.monotonic() < deadline:
        log.warning("SIGKILL %d process(es) of launch %s that ignored SIGTERM", len(live), tag[:8])
        _signal(live, signal.SIGKILL)
        psutil.wait_procs(live, timeout=2)
    if live:
        raise RuntimeError(f"launch {tag[:8]}: {len(live)} process(es) survived SIGKILL: {[p.pid for p in live]}")
    return len(first)
