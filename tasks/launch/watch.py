"""Hang detection and the failure reason, from the run's status file (tasks/base/job_status.py).

Why the status and not the process table or the logs: a rank stuck in a collective (its
peer SIGSTOPped, a dead NIC) is alive and idle, and log lines are for people (rewording one
must not break supervision). Rank 0 replaces the status after every step; a step that has
not moved for `hang_timeout_s` is a hang, and a `failed` status carries the reason.
"""

from __future__ import annotations

import logging
import time

from tasks.base.job_status import Status

log = logging.getLogger(__name__)


class ProgressWatcher:
    """Follows the statuses a job reports; `hung()` once the step stops moving for too long."""

    def __init__(self, timeout_s: float, *, startup_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        # Before the first step of this launch (imports, rendezvous, op builds) a longer allowance may apply.
        self.startup_timeout_s = timeout_s if startup_timeout_s is None else startup_timeout_s
        self._started = False
        self._first_step: int | None = None
        self._last_progress = time.monotonic()
        self.last_step: int | None = None
        self.last_loss: float | None = None
        self.failure: str | None = None

    def observe(self, status: Status | None) -> None:
        """Take the job's latest status (None: none yet)."""
        if status is None:
            return
        if status.state == "failed":
            self.failure = self.failure or status.reason or "a rank reported a failure without a reason"
            return
        if self._first_step is None:
            self._first_step = status.step  # where this launch starts (a resumed run starts past 0)
            self._last_progress = time.monotonic()
        if self.last_step is None or status.step > self.last_step:
            if self.last_step is not None or status.step > self._first_step:
                self._started = True
            self.last_step, self.last_loss = status.step, status.loss
            self._last_progress = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self._last_progress

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self._started else self.startup_timeout_s

    def hung(self) -> bool:
        return self.stalled_for() > self.limit_s

    def describe(self) -> str:
        where = f"last finished step {self.last_step}" if self.last_step else "no step finished"
        limit = "hang_timeout_s" if self._started else "startup timeout"
        return f"no progress (the step did not move) for {self.stalled_for():.0f}s > {limit}={self.limit_s:g}s; {where}"
