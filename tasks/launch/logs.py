"""Stream job output into `logging` (hence into the Airflow task log), from a pipe or a growing file.

Why threads: the supervisor loop must keep checking for hangs and signals
while output arrives; a blocked read must never stall cancellation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tasks.base.job_status import Status, parse_relay, parse_summary, parse_tagged, split_level
from tasks.base.rank_failure import LINE_PREFIX, RankFailure, earliest


class LineSink:
    """Logs each line with a prefix, at the level the line starts with (`log_for_relay`: a rank's WARNING
    stays a WARNING). A status a node agent relays (tasks/base/job_status.py) is kept as the job's latest
    status, and a failed rank a node's spawner reports (tasks/base/rank_failure.py) as the earliest one, not
    logged: supervision never reads the log text itself."""

    def __init__(self, logger: logging.Logger, prefix: str = "") -> None:
        self.logger, self.prefix = logger, prefix
        self.status: Status | None = None
        self.summary: dict[str, Any] | None = None
        self.rank_failure: RankFailure | None = None
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        line = line.rstrip("\r\n")
        relayed = parse_relay(line)
        if relayed is not None:
            with self._lock:
                if self.status is None or relayed.at >= self.status.at:
                    self.status = relayed
            return
        if (summary := parse_summary(line)) is not None:
            self.summary = summary
            return
        if (failure := RankFailure.from_dict(parse_tagged(line, LINE_PREFIX))) is not None:
            with self._lock:
                self.rank_failure = earliest([self.rank_failure, failure])
            return
        level, text = split_level(line)
        self.logger.log(level, "%s%s", self.prefix, text)


def pump(stream: IO[str], sink: Callable[[str], None], *, name: str = "log-pump") -> threading.Thread:
    """Start a daemon thread that feeds every line of `stream` to `sink` until EOF."""

    def run() -> None:
        try:
            for line in stream:
                sink(line)
        except (OSError, ValueError):  # closed under us during cancellation
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class FileTail:
    """Follows a file another machine writes (e.g. Slurm's job output); `stop()` drains the rest."""

    def __init__(self, path: str | Path, sink: Callable[[str], None], *, interval_s: float = 0.5) -> None:
        self.path, self.sink, self.interval_s = Path(path), sink, interval_s
        self._stop = threading.Event()
        self._offset = 0
        self._partial = ""
        self._thread = threading.Thread(target=self._run, name=f"tail-{self.path.name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with open(self.path, errors="replace") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
                self._offset = fh.tell()
        except FileNotFoundError:
            return
        *lines, self._partial = (self._partial + chunk).split("\n")
        for line in lines:
            self.sink(line)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._read()
        if self._partial:
            self.sink(self._partial)
            self._partial = ""
