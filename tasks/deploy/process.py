"""The deploy's child processes (the smoke test, the hook): each in its own session that dies with us, its output
logged line by line, its whole process group killed on timeout."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from collections import deque

from tasks import REPO_ROOT
from tasks.base.spawn import die_with_parent

log = logging.getLogger(__name__)

_TAIL_LINES = 20  # lines of a child's output kept for the failure's reason


def run_logged(argv: list[str], *, env: dict[str, str], timeout_s: float, what: str) -> tuple[int | None, list[str]]:
    """Run a child in its own session (it dies with us), its output logged line by line; (exit code or None on
    timeout, the last lines of its output). On timeout its whole process group is killed."""
    import signal

    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
                            preexec_fn=die_with_parent)
    tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def follow() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            log.info("%s: %s", what, line)
            tail.append(line)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        log.error("%s: still running after %g s: killing it", what, timeout_s)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    return rc, list(tail)


def died(rc: int | None, tail: list[str], timeout_s: float) -> str:
    """Why a child failed, as a reason names it: its timeout, its signal or exit code, and its last line."""
    if rc is None:
        return f"timed out after {timeout_s:g} s"
    last = tail[-1] if tail else "no output"
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited {rc}"
    return f"the process {how}: {last}"
