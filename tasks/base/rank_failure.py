"""A rank's failure, from the exception it raised to the one line the person reads in the launcher's error.

Why: a rank that dies of an exception nobody anticipated (an IndexError deep in the data path, on rank 3
of 64) used to reach the person as "exit status 1", its traceback somewhere in one node's output. As
torchelastic does with its error files, the rank program's entry point records its uncaught exception
into the file `tasks.base.spawn` names for it (`ERROR_FILE_VAR`): its type, message, the innermost frame of our
or the user's code (library frames skipped: the line to fix, not torch's `F.embedding`) and the
traceback; no locals, no environment. `tasks.base.spawn`, on every node whatever the launcher, prints a failed
rank's record as one `RETRAINER-RANK-FAILURE {json}` line into the output every launcher follows (a pipe,
an ssh channel, Slurm's output file, pod logs), and the launcher names the earliest one (by time, not
rank number: the other ranks usually die afterwards, of the collective it broke).

Standard library only: `tasks.base.spawn` imports nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sysconfig
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

ERROR_FILE_VAR = "RETRAINER_ERROR_FILE"  # set by tasks.base.spawn for each rank: where its failure is recorded
LINE_PREFIX = "RETRAINER-RANK-FAILURE "
MESSAGE_CHARS = 500  # the error stays one readable line
LINE_BYTES = 4000  # under PIPE_BUF (4096): one write that other ranks' output cannot tear apart

_ROOT = Path(__file__).resolve().parents[2]  # the repository (two above tasks/base/): frames are shown relative to it
_LIBRARY_DIRS = tuple(sorted({sysconfig.get_path(name) + os.sep for name in ("stdlib", "platstdlib", "purelib",
                                                                               "platlib")}))


@dataclass(frozen=True)
class RankFailure:
    """One failed rank: its exception (`type` None: it died without one, e.g. by a signal) and exit code."""

    rank: int
    at: float  # unix time of the failure: the earliest one is the cause
    host: str = ""
    type: str | None = None
    message: str = ""
    where: str | None = None  # file:line of the innermost frame of our or the user's code
    traceback: str = ""
    exit_code: int | None = None  # as tasks.base.spawn saw the rank end

    def describe(self) -> str:
        """One line: `rank 3 failed: IndexError: index out of range in self (tasks/x.py:12 on gpu-07)`."""
        where = " ".join(filter(None, [self.where, self.host and f"on {self.host}"]))
        if self.type is not None:
            what = "failed: " + (f"{self.type}: {self.message}" if self.message else self.type)
        elif self.exit_code is not None and self.exit_code < 0:
            what = f"was killed by {_signal_name(-self.exit_code)}"
        else:  # os._exit, or an exception before its entry point ran (its output has the traceback)
            what = f"exited with code {self.exit_code} without recording an exception"
        return f"rank {self.rank} {what}" + (f" ({where})" if where else "")

    def line(self) -> str:
        """The record as one tagged output line of at most LINE_BYTES (the traceback's oldest frames cut)."""
        failure = self
        while True:
            text = LINE_PREFIX + json.dumps(asdict(failure), ensure_ascii=False, separators=(",", ":"))
            excess = len(text.encode()) - LINE_BYTES
            if excess <= 0 or not failure.traceback:
                return text
            kept = failure.traceback[excess + 8:]
            failure = replace(failure, traceback="...\n" + kept if kept else "")

    @classmethod
    def from_dict(cls, data: Any) -> RankFailure | None:
        """A record as `line()` or `asdict` wrote it; None for anything else."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(**data)
        except TypeError:
            return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def earliest(failures: Iterable[RankFailure | None]) -> RankFailure | None:
    """The failure that came first (the cause), of those reported."""
    return min((f for f in failures if f is not None), key=lambda f: f.at, default=None)


def record(exc: BaseException) -> bool:
    """Record `exc` as this rank's failure in the file tasks.base.spawn named for it; False when none was named
    (the rank runs without tasks.base.spawn: its caller prints the traceback as usual)."""
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        return False
    failure = RankFailure(
        rank=int(os.environ.get("RANK", "0")), at=time.time(), host=socket.gethostname(), type=type(exc).__qualname__,
        message=_one_line(str(exc)), where=_innermost_own_frame(exc.__traceback__),
        traceback="".join(traceback.format_exception(exc)))
    Path(path).write_text(json.dumps(asdict(failure)))  # read only once this rank has exited
    return True


def read(path: str | os.PathLike[str], exit_code: int | None) -> RankFailure | None:
    """The failure a rank recorded at `path` (None: it recorded none), with the exit code it ended with."""
    try:
        failure = RankFailure.from_dict(json.loads(Path(path).read_text()))
    except (FileNotFoundError, ValueError):
        return None
    return None if failure is None else replace(failure, exit_code=exit_code)


def unrecorded(rank: int, exit_code: int | None) -> RankFailure:
    """A rank that ended without recording an exception (a signal, `os._exit`, an error before its entry
    point ran): what is known is its exit code, now."""
    return RankFailure(rank=rank, at=time.time(), host=socket.gethostname(), exit_code=exit_code)


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def _is_library(filename: str) -> bool:
    parts = Path(filename).parts
    return (filename.startswith("<") or "site-packages" in parts or "dist-packages" in parts
            or filename.startswith(_LIBRARY_DIRS))


def _innermost_own_frame(tb: TracebackType | None) -> str | None:
    """`file:line` of the innermost frame outside the standard library and installed packages (the
    innermost frame of all when every frame is a library's); repository files relative to it."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if not _is_library(f.filename)), frames[-1])
    path = Path(frame.filename)
    shown = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path
    return f"{shown}:{frame.lineno}"
