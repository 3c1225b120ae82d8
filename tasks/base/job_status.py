"""The run's status file: what supervisors read instead of parsing log lines.

Rank 0 replaces `<output_dir>/status.json` atomically after every step (step, loss, time,
state); a rank that fails with a known reason (non-finite loss, a foreign checkpoint, ...)
writes `failed` and the reason. Launchers supervise from it: hang detection is "the step
has not moved for hang_timeout_s", the failure reason is the file's `reason`. Log lines are
for people and may be reworded freely.

Where the launcher cannot read the run directory (a node-local disk over ssh, a pod), the
node agent relays each new status as one line `RETRAINER-STATUS <json>` on its output,
which the launcher already follows (`relay_line` / `parse_relay`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.base.fsutil import atomic_write_bytes

STATUS_FILE = "status.json"
RELAY_PREFIX = "RETRAINER-STATUS "
SUMMARY_PREFIX = "RETRAINER-SUMMARY "  # the finished run's summary.json, relayed once by node 0's agent
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
State = Literal["starting", "training", "evaluating", "finished", "failed"]


@dataclass(frozen=True)
class Status:
    state: State
    step: int  # last finished step (0: none yet)
    steps: int  # steps the run trains to
    loss: float | None = None
    at: float = 0.0  # unix time of this status
    reason: str | None = None  # why the run failed
    rank: int = 0  # who wrote it

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Status | None:
        try:
            data: Any = json.loads(text)
            return cls(**data) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None


def write_status(output_dir: str | Path, status: Status) -> None:
    """Replace the job's status; a failure stays: a rank that has not yet noticed another rank's failure
    must not write progress over the reason the launcher reports (seen: "exit status 1" instead of the
    failed rank's "No space left on device")."""
    path = Path(output_dir) / STATUS_FILE
    if status.state != "failed":
        current = read_status(path)
        if current is not None and current.state == "failed":
            return
    atomic_write_bytes(path, status.to_json().encode(), durable=False)


def read_status(path: str | Path) -> Status | None:
    try:
        return Status.from_json(Path(path).read_text())
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def now() -> float:
    return time.time()


def relay_line(status: Status) -> str:
    return RELAY_PREFIX + status.to_json()


def parse_relay(line: str) -> Status | None:
    """The status a relayed line carries, or None for an ordinary log line."""
    if not line.startswith(RELAY_PREFIX):
        return None
    return Status.from_json(line[len(RELAY_PREFIX):])


def summary_line(text: str) -> str:
    """A summary.json as one relay line (compact JSON)."""
    return SUMMARY_PREFIX + json.dumps(json.loads(text), separators=(",", ":"))


def print_line(line: str) -> None:
    """`line` and its newline to stdout in one write: a tagged line a launcher parses must not be split between its
    text and its newline by the process's stderr, which shares the launcher's pipe (seen: an ssh node's warm
    report and a log line on one line, the report unread; `print` writes the text and the newline apart when
    stdout is unbuffered)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_tagged(line: str, prefix: str) -> dict[str, Any] | None:
    """The JSON object a `<prefix>{json}` relay line carries (summaries, warm reports), else None."""
    if not line.startswith(prefix):
        return None
    try:
        obj = json.loads(line[len(prefix):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_summary(line: str) -> dict[str, Any] | None:
    """The summary a relayed line carries, or None."""
    return parse_tagged(line, SUMMARY_PREFIX)


def log_for_relay(who: str | None = None) -> None:
    """Logging of a process whose output a launcher relays into its own log (`LineSink`): each line starts
    with its level, which the relay keeps, and carries no time (the log it lands in stamps every line);
    Python warnings become WARNING lines."""
    where = f"[{who}] " if who else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(levelname)s {where}%(name)s: %(message)s")
    logging.captureWarnings(True)


def split_level(line: str) -> tuple[int, str]:
    """A relayed line's level and the rest of it; INFO for a line without one (the spawner's own, a shell's)."""
    word, _, rest = line.partition(" ")
    if word in LEVELS:
        return logging.getLevelNamesMapping()[word], rest
    return logging.INFO, line
