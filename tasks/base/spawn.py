"""One node's ranks, started the way torchrun starts them, without importing torch first.

Why not torchrun: its agent imports torch and sets up an elastic rendezvous before the first rank starts
(3.5 s of CPU on a quiet box, for ranks that then import torch themselves), and a job here never restarts a
worker group (torchrun's `--max-restarts` was 0). This keeps torchrun's interface: the same flags
(`tasks.launch.torchrun.node_command` builds them, `tasks.launch.shell` fills node rank and rendezvous in
under Slurm and Kubernetes), and each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, ...), so `init_process_group("env://")` meets at
the master address: global rank 0 holds the rendezvous store, the others connect to it, on any node.

It stops every rank when one fails (exit 1) or when it is told to stop (SIGTERM, SIGINT, SIGHUP: exit
128 + the signal), SIGKILLing those still alive after a grace. A failed rank is reported at once, before
the others are stopped (a pod may be deleted soon after), as the failure it recorded (tasks/base/rank_failure.py:
each rank gets its own error file) or, if it recorded none, its exit code or signal: one log line and one
`RETRAINER-RANK-FAILURE` line on stdout, which the launcher follows; ranks that fail while they are being
stopped are reported after. The ranks stay in its process group and get SIGTERM if it dies
(`die_with_parent`). It lives outside `tasks.launch`, whose package loads the config layer (0.7 s), and
imports nothing but the standard library (and tasks/base/rank_failure.py, which imports nothing else).

On a node without GPUs it forks the ranks instead (`forks_ranks`): a rank program `-m MODULE` whose module has a
`preload(args)` (tasks/train/start.py: torch, DeepSpeed and the worker module, 1.6 s of CPU) is imported once
here and each rank is forked from this process, so a node pays the imports once instead of once per rank
(they were most of a CPU job's start-up and of the test suite's CPU). Never where a GPU may be used: CUDA does
not survive a fork of a process that touched it, so there every rank is its own new process, as above.

    python -m tasks.base.spawn --nnodes=N --node-rank=R --nproc-per-node=P --master-addr=A --master-port=M
                                 (-m MODULE | SCRIPT) [ARGS...]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import io
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from tasks.base.rank_failure import ERROR_FILE_VAR, RankFailure, read, unrecorded

log = logging.getLogger("tasks.base.spawn")

GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL of its workers
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
# torchrun's flags that take a value (given as `--flag=value` by node_command, or as two words).
_VALUE_FLAGS = {"--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port", "--grace"}


def die_with_parent() -> None:
    """`preexec_fn` for the processes a launcher starts: SIGTERM them when the launcher dies.

    A SIGKILLed Airflow task process runs no cleanup; without this, the node's ranks (in their own
    session) would keep training next to the retry. On SIGTERM this module stops its ranks, an
    ssh client's exit closes the remote agent's stdin (which then reaps its node).
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, "PR_SET_PDEATHSIG")


def _prctl(option: int, arg: int | bytes, what: str) -> None:
    """prctl(2) of this process (Linux), raising OSError naming `what` where it fails."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The node's flags, and the rank's command after them (`-m MODULE ...` or `SCRIPT ...`)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.base.spawn", allow_abbrev=False)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    argv = list(argv)
    split = 0
    while split < len(argv) and argv[split] != "-m" and argv[split].startswith("-"):
        split += 2 if argv[split] in _VALUE_FLAGS else 1
    args, target = parser.parse_args(argv[:split]), argv[split:]
    if not target or target == ["-m"]:
        parser.error("the rank's module (-m MODULE) or script is missing")
    if not 0 <= args.node_rank < args.nnodes or args.nproc_per_node < 1:
        parser.error(f"--node-rank {args.node_rank} of --nnodes {args.nnodes}, --nproc-per-node "
                     f"{args.nproc_per_node}: no such node")
    return args, target


def rank_environment(args: argparse.Namespace, local_rank: int) -> dict[str, str]:
    """What torchrun sets for one of its workers (static rendezvous, no restarts)."""
    world = args.nnodes * args.nproc_per_node
    rank = args.node_rank * args.nproc_per_node + local_rank
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
        "GROUP_RANK": str(args.node_rank),
        "GROUP_WORLD_SIZE": str(args.nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


# Device files of an accelerator torch may drive (NVIDIA, AMD ROCm, WSL's GPU): a node with one never forks ranks.
_ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
_PR_SET_NAME = 15
# A forked rank's process name (`ps -o comm`, /proc/PID/comm), its global rank after it: its command line is its
# spawner's.
FORKED_RANK_NAME = "rank "


class ForkedRank:
    """A rank forked from this process: what `_run` and `_stop` use of a `subprocess.Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen's
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self) -> int | None:
        return self._reaped(0)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forks_ranks(target: Sequence[str]) -> bool:
    """Whether this node's ranks are forked from this process, which has then imported what each of them imports:
    a rank program `-m MODULE` with a `preload(args)` function, on a node with no accelerator device, as long as
    this process is still single-threaded after it. A preload that fails starts the ranks as processes of their
    own, which meet the same failure and report it as ranks."""
    if len(target) < 2 or target[0] != "-m" or any(glob.glob(pattern) for pattern in _ACCELERATOR_DEVICES):
        return False
    try:
        preload = getattr(importlib.import_module(target[1]), "preload", None)
        if preload is None:
            return False
        preload(list(target[2:]))
    except Exception as exc:
        log.warning("could not preload the ranks' program (%s: %s): starting each rank as a new process",
                    type(exc).__name__, exc)
        return False
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # a thread's locks (an OpenMP pool's, an allocator's) would be held forever in a forked copy
        log.warning("preloading the ranks' program started %d threads: starting each rank as a new process",
                    threads - 1)
        return False
    return True


def _fork_rank(target: Sequence[str], env: dict[str, str]) -> ForkedRank:
    """Fork one rank running `-m MODULE ARGS` as `__main__` with `env` added, as a new process would: default
    signal handlers, no logging configured, `sys.argv` its own; it never returns into this module's loop."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent()
        os.environ.update(env)
        _prctl(_PR_SET_NAME, f"{FORKED_RANK_NAME}{env['RANK']}".encode(), "PR_SET_NAME")
        logging.root.handlers.clear()
        for name in ("stdout", "stderr"):  # unbuffered, as `python -u` starts a rank
            stream = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(open(stream.fileno(), "wb", buffering=0, closefd=False),  # noqa: SIM115
                                                encoding=stream.encoding, errors=stream.errors, write_through=True))
        sys.argv = [target[1], *target[2:]]
        sys.modules.pop(target[1])  # run as `__main__` beside no copy of itself, as in a new process
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(ranks: list[subprocess.Popen] | list[ForkedRank], grace_s: float) -> None:
    """SIGTERM the live ranks (SIGCONT too: a stopped one must see it), SIGKILL those left after the grace."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in ranks:
        if proc.poll() is None:
            log.warning("rank pid %d ignored SIGTERM for %.0f s: SIGKILL", proc.pid, grace_s)
            proc.kill()
    for proc in ranks:
        proc.wait()


def _report(failure: RankFailure, *, cause: bool) -> None:
    """Log a failed rank and print its record for the launcher, in one write (other ranks may be printing)."""
    if cause:
        log.error("%s; stopping this node's other ranks", failure.describe())
    else:
        log.warning("then %s", failure.describe())
    with contextlib.suppress(OSError):  # a closed output (the launcher gone) must not keep the ranks alive
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (failure.line() + "\n").encode())


def main(argv: Sequence[str] | None = None) -> int:
    args, target = _parse(sys.argv[1:] if argv is None else argv)
    stop_signal: list[int] = []

    def on_stop(signum: int, frame: object) -> None:
        stop_signal.append(signum)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, on_stop)
    errors = Path(tempfile.mkdtemp(prefix="retrainer-ranks-"))  # node-local: each rank's error file
    try:
        return _run(args, target, errors, stop_signal)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _run(args: argparse.Namespace, target: list[str], errors: Path, stop_signal: list[int]) -> int:
    first = args.node_rank * args.nproc_per_node
    error_files = [errors / f"rank-{first + local}.json" for local in range(args.nproc_per_node)]
    envs = [{**rank_environment(args, local), ERROR_FILE_VAR: str(error_files[local])}
            for local in range(args.nproc_per_node)]
    ranks: list[subprocess.Popen] | list[ForkedRank]
    if forks_ranks(target):
        ranks = [_fork_rank(target, env) for env in envs]
    else:
        ranks = [subprocess.Popen([sys.executable, "-u", *target], env={**os.environ, **env},
                                  preexec_fn=die_with_parent) for env in envs]
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            failures = [read(error_files[i], codes[i]) or unrecorded(first + i, codes[i]) for i in failed]
            cause = min(failures, key=lambda f: f.at)
            _report(cause, cause=True)  # at once: a node may be torn down soon after one of its ranks failed
            _stop(ranks, args.grace)
            later = [read(error_files[i], proc.returncode) for i, proc in enumerate(ranks) if i not in failed]
            for failure in sorted([f for f in failures if f is not cause] + [f for f in later if f is not None],
                                  key=lambda f: f.at):
                _report(failure, cause=False)
            return 1
        if stop_signal:
            log.warning("signal %d: stopping this node's ranks", stop_signal[0])
            _stop(ranks, args.grace)
            return 128 + stop_signal[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as log_for_relay
    code = main()
    # No interpreter teardown: with the ranks' imports preloaded, torch's and DeepSpeed's would take ~0.5 s
    # after the job is done (the ranks leave the same way: tasks/train/rank.py `exit_without_teardown`).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
