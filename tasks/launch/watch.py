"""Hang detection: a job that writes no telemetry line for too long is declared hung.

Why telemetry and not the process table: a rank stuck in a collective (its peer
SIGSTOPped, a dead NIC) is alive and idle; only the absence of progress tells.
Rank 0 appends one JSON line per finished step to `<output_dir>/telemetry.jsonl`
(a shared filesystem across nodes), so "no new line for hang_timeout_s" is the
signal, and the last line names the last finished step.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


class ProgressWatcher:
    """Tracks growth of a telemetry file; `stalled_for()` is seconds since the last new line."""

    def __init__(self, path: str | Path, timeout_s: float, *, startup_timeout_s: float | None = None) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        # Before the first step of this launch (imports, rendezvous, op builds) a longer allowance may apply.
        self.startup_timeout_s = timeout_s if startup_timeout_s is None else startup_timeout_s
        self._started = False
        self._offset = self._size()  # a resumed run appends: only lines after launch count
        self._last_progress = time.monotonic()
        self._partial = b""
        self.last_step: int | None = None
        self.last_loss: float | None = None

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def poll(self) -> bool:
        """Read new complete lines; True when at least one arrived."""
        size = self._size()
        if size < self._offset:  # a fresh run truncated the file
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return False
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read(size - self._offset)
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        progressed = False
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                self.last_step, self.last_loss = row["step"], row.get("loss")
                progressed = True
        if progressed:
            self._last_progress = time.monotonic()
            self._started = True
        return progressed

    def note_step(self, step: int | None) -> None:
        """Progress seen elsewhere (rank 0's step line in a streamed log)."""
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step
            self._last_progress = time.monotonic()
            self._started = True

    def stalled_for(self) -> float:
        self.poll()
        return time.monotonic() - self._last_progress

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self._started else self.startup_timeout_s

    def hung(self) -> bool:
        return self.stalled_for() > self.limit_s

    def describe(self) -> str:
        where = f"last finished step {self.last_step}" if self.last_step is not None else "no step finished"
        idle = self.stalled_for()
        limit = "hang_timeout_s" if self._started else "startup timeout"
        return f"no progress (no telemetry line) for {idle:.0f}s > {limit}={self.limit_s:g}s; {where}"
