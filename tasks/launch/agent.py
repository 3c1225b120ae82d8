"""The per-node agent the `ssh` launcher starts: runs torchrun there and guarantees cleanup there.

Why an agent: killing an ssh client does not kill what it started on the
remote host (no tty, no signal is forwarded), and torchrun puts every rank in
its own session. The agent runs on the node, holds the job as a child, and
stops every process carrying the launch tag when its stdin closes (the
launcher cancelled, or the launcher/ssh connection died), or on SIGTERM/SIGHUP.
`reap` is the launcher's second check: it stops any leftover of a launch on a
node and exits 0 only when none is left.

    python -m tasks.launch.agent run --tag TAG [--grace S] -- CMD...
    python -m tasks.launch.agent reap --tag TAG [--grace S]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from tasks.launch.procs import TAG_VAR, die_with_parent, stop_all, tagged

log = logging.getLogger("tasks.launch.agent")

CANCELLED = 143


def run(tag: str, cmd: Sequence[str], grace_s: float) -> int:
    cancel = threading.Event()

    def watch_stdin() -> None:
        try:  # os.read, not sys.stdin: a daemon thread must not hold the buffered reader's lock at exit
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        cancel.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda s, f: cancel.set())
    env = {**os.environ, TAG_VAR: tag}
    child = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=die_with_parent)
    log.info("agent pid %d: job pid %d started", os.getpid(), child.pid)
    threading.Thread(target=watch_stdin, daemon=True).start()
    while child.poll() is None and not cancel.wait(0.2):
        pass
    if cancel.is_set() and child.poll() is None:
        log.warning("agent: cancel received; stopping the job on this node")
        stop_all(tag, root_pid=child.pid, grace_s=grace_s)
        child.wait()
        return CANCELLED
    rc = child.wait()
    leftovers = stop_all(tag, grace_s=grace_s)
    if leftovers:
        log.warning("agent: job exited %d leaving %d process(es); stopped them", rc, leftovers)
    return rc


def reap(tag: str, grace_s: float) -> int:
    stopped = stop_all(tag, grace_s=grace_s)
    left = tagged(tag)
    print(f"reaped={stopped} left={len(left)}", flush=True)
    return 0 if not left else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.launch.agent")
    parser.add_argument("action", choices=["run", "reap"])
    parser.add_argument("--tag", required=True)
    parser.add_argument("--grace", type=float, default=15.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.action == "reap":
        return reap(args.tag, args.grace)
    if not cmd:
        parser.error("run needs a command after --")
    return run(args.tag, cmd, args.grace)


if __name__ == "__main__":
    sys.exit(main())
