"""The per-node agent: runs the node's ranks (`tasks.base.spawn`), guarantees cleanup there, and relays the run's
status.

Why an agent: killing an ssh client does not kill what it started on the
remote host (no tty, no signal is forwarded), and a rank may start processes in
their own session. The agent runs on the node, holds the job as a child, and
stops every process carrying the launch tag when its stdin closes (the
launcher cancelled, or the launcher/ssh connection died; `--watch-stdin`), or on
SIGTERM/SIGHUP. With `--env-stdin` the first line on stdin is the ranks'
environment as JSON (so no value ever sits on a command line, where `ps` on the
node would show it). With `--relay-status PATH` it prints each new status of the
run (tasks/base/job_status.py) as one `RETRAINER-STATUS` line on its output, which
the launcher follows: the run directory may be on this node's own disk. So may
the job's input: with `--files-stdin` the next stdin line is a JSON object
{path: text} of files written (0600) before the job starts and removed after it;
with `--relay-summary PATH` the job's summary is printed as one `RETRAINER-SUMMARY`
line when it exits 0. `reap`
is the launcher's second check: it stops any leftover of a launch on a node and
exits 0 only when none is left.

    python -m tasks.launch.agent run --tag TAG [--grace S] [--watch-stdin] [--env-stdin] [--files-stdin]
                                     [--relay-status PATH] [--relay-summary PATH] -- CMD...
    python -m tasks.launch.agent reap --tag TAG [--grace S]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from tasks.base.fsutil import atomic_write_bytes
from tasks.base.job_status import log_for_relay, print_line, read_status, relay_line, summary_line
from tasks.base.spawn import die_with_parent
from tasks.launch.procs import TAG_VAR, stop_all, tagged

log = logging.getLogger("tasks.launch.agent")

CANCELLED = 143


def _read_json_line(what: str) -> dict[str, str]:
    """The next line on stdin as a JSON object of strings (read byte-wise: the rest of stdin is the
    liveness channel)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            break
        line += chunk
    obj = json.loads(line or b"{}")
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in obj.items()):
        raise SystemExit(f"agent: {what} expects one JSON object of strings")
    return obj


def _write_files(files: dict[str, str]) -> None:
    for path, text in files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, text.encode())
        os.chmod(path, 0o600)


class _StatusRelay:
    """Prints the run's status as a relay line whenever the status file changes."""

    def __init__(self, path: Path) -> None:
        self.path, self._last = path, ""

    def once(self) -> None:
        status = read_status(self.path)
        if status is not None and (line := relay_line(status)) != self._last:
            self._last = line
            print_line(line)

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            self.once()


def run(tag: str, cmd: Sequence[str], grace_s: float, *, watch_stdin: bool, env_stdin: bool,
        relay_status: Path | None, files_stdin: bool = False, relay_summary: Path | None = None) -> int:
    cancel = threading.Event()
    extra = _read_json_line("--env-stdin") if env_stdin else {}
    files = _read_json_line("--files-stdin") if files_stdin else {}
    try:
        _write_files(files)
        return _run(tag, cmd, grace_s, cancel, extra, watch_stdin=watch_stdin, relay_status=relay_status,
                    relay_summary=relay_summary)
    finally:
        for path in files:
            Path(path).unlink(missing_ok=True)


def _run(tag: str, cmd: Sequence[str], grace_s: float, cancel: threading.Event, extra: dict[str, str], *,
         watch_stdin: bool, relay_status: Path | None, relay_summary: Path | None) -> int:

    def watch() -> None:
        try:  # os.read, not sys.stdin: a daemon thread must not hold the buffered reader's lock at exit
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        cancel.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda s, f: cancel.set())
    env = {**os.environ, **extra, TAG_VAR: tag}
    child = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=die_with_parent)
    log.info("agent pid %d: job pid %d started", os.getpid(), child.pid)
    if watch_stdin:
        threading.Thread(target=watch, daemon=True).start()
    relay = _StatusRelay(relay_status) if relay_status else None
    relay_stop = threading.Event()
    if relay:
        threading.Thread(target=relay.loop, args=(relay_stop,), daemon=True).start()
    try:
        while child.poll() is None and not cancel.wait(0.2):
            pass
        if cancel.is_set() and child.poll() is None:
            log.warning("agent: cancel received; stopping the job on this node")
            stop_all(tag, root_pid=child.pid, grace_s=grace_s)
            child.wait()
            return CANCELLED
        rc = child.wait()
    finally:
        relay_stop.set()
        if relay:
            relay.once()  # the ranks' last word (a failure reason) is written just before they exit
    leftovers = stop_all(tag, grace_s=grace_s)
    if leftovers:
        log.warning("agent: job exited %d leaving %d process(es); stopped them", rc, leftovers)
    if rc == 0 and relay_summary is not None and relay_summary.is_file():
        print_line(summary_line(relay_summary.read_text()))
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
    parser.add_argument("--watch-stdin", action="store_true", help="stop the job when stdin closes")
    parser.add_argument("--env-stdin", action="store_true", help="first stdin line: the job's env as JSON")
    parser.add_argument("--files-stdin", action="store_true", help="next stdin line: {path: text} to write first")
    parser.add_argument("--relay-status", type=Path, help="print the run's status file as relay lines")
    parser.add_argument("--relay-summary", type=Path, help="print this summary file as a relay line on success")
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    log_for_relay()
    if args.action == "reap":
        return reap(args.tag, args.grace)
    if not cmd:
        parser.error("run needs a command after --")
    return run(args.tag, cmd, args.grace, watch_stdin=args.watch_stdin, env_stdin=args.env_stdin,
               relay_status=args.relay_status, files_stdin=args.files_stdin, relay_summary=args.relay_summary)


if __name__ == "__main__":
    sys.exit(main())
