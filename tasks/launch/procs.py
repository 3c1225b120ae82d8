"""Find and stop every process of one launch, even those that escaped their process group.

Why a tag and not only a process group: a rank may start processes in a new session
(`start_new_session=True`), which `killpg` misses, and a process whose parent died
is re-parented to init where a tree walk cannot see it.
Every process a launcher starts carries `RETRAINER_LAUNCH_ID=<id>` in its
environment, which children inherit; `/proc/<pid>/environ` finds them all.

Why the environments are read by a thread with a bound: reading another process's environment takes that
process's memory-map lock, which it may hold for as long as a stalled disk or a hung NFS server keeps it in a page
fault or in reclaim (`ps` hangs on such a process for the same reason). One such process anywhere on the node
would block every scan, and so every stop, for as long as the stall. A read that has not returned after
`ENVIRON_READ_TIMEOUT_S` is left to its thread and the process skipped, with a warning, until that read returns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid

import psutil

log = logging.getLogger(__name__)

TAG_VAR = "RETRAINER_LAUNCH_ID"


def new_tag() -> str:
    return uuid.uuid4().hex


ENVIRON_READ_TIMEOUT_S = 2.0
_unanswered: set[int] = set()  # pids whose environment a left-behind reader still waits for
_lock = threading.Lock()


def _environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return fh.read().split(b"\0")


class _Scan(threading.Thread):
    """Reads the environments of `pids` in turn, keeping those that hold `needle`. `reading`: the index of the pid
    being read, None between reads (under `_lock`, as `left` and `matched`)."""

    def __init__(self, pids: list[int], needle: bytes) -> None:
        super().__init__(daemon=True, name="environ-scan")  # a reader left waiting never holds up an exit
        self.pids, self.needle = pids, needle
        self.reading: int | None = None
        self.left, self.matched, self.done = False, list[int](), threading.Event()

    def run(self) -> None:
        for index, pid in enumerate(self.pids):
            with _lock:
                if pid in _unanswered:
                    continue
                self.reading = index
            try:
                held = self.needle in _environ(pid)
            except OSError:
                held = False
            with _lock:
                if self.left:  # the caller went on without this reader: the pid may be read again
                    _unanswered.discard(pid)
                    return
                self.reading = None
                if held:
                    self.matched.append(pid)
        self.done.set()

    def leave_if_still_reading(self, index: int | None) -> bool:
        """If the read of pid `index`, under way at the last look, still is: go on without this reader (that pid
        skipped until the read returns)."""
        with _lock:
            if index is None or self.reading != index:
                return False
            self.left = True
            _unanswered.add(self.pids[index])
            return True


def _holding(pids: list[int], needle: bytes) -> list[int]:
    """The pids whose environment holds `needle`, each read waited for at most ENVIRON_READ_TIMEOUT_S."""
    matched: list[int] = []
    while True:
        scan = _Scan(pids, needle)
        scan.start()
        seen: int | None = 0  # indices only grow: the same one at two looks is one read that long
        while not scan.done.wait(ENVIRON_READ_TIMEOUT_S):
            if scan.leave_if_still_reading(seen):
                break
            seen = scan.reading
        else:
            return matched + scan.matched
        matched += scan.matched  # final: a reader left adds nothing more
        log.warning("process %d: its environment could not be read in %.0f s (state %s): skipped until it can be",
                    pids[seen], ENVIRON_READ_TIMEOUT_S, _state(pids[seen]))
        pids = pids[seen + 1:]


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def tagged(tag: str, *, exclude: set[int] | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries this launch tag (zombies count as gone); a process whose
    environment cannot be read in time is skipped (module docstring)."""
    skip = {os.getpid(), *(exclude or set())}
    found = []
    for pid in _holding([pid for pid in psutil.pids() if pid not in skip], f"{TAG_VAR}={tag}".encode()):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
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
