"""A rank's host memory over a run: its resident set after each step, kept as a bounded trace, and its peak.

Why: a rank whose memory climbs a little with every step and save (issue 38: glibc's heap kept what the
checkpoint snapshots freed) looks fine at any one moment and fails hours later; the trace in the run's summary
shows the climb or the plateau, per rank, and what the planner's process term must cover. Bounded so that a
long run's summary stays small: at most `MAX_POINTS` points; when full, every other point is dropped and the
stride doubles; the latest point is always kept.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

PROC_STATUS = Path("/proc/self/status")
MAX_POINTS = 256

Point = list[Any]  # [step, rss_bytes, anon_bytes]; the bytes None without /proc


def rss_now() -> tuple[int | None, int | None]:
    """This process's resident set and its anonymous part (`VmRSS`, `RssAnon`) in bytes; None without /proc.

    The anonymous part is what the process allocated itself; the rest is mapped files (code, a checkpoint
    mapped on resume), which the kernel may drop under pressure."""
    try:
        text = PROC_STATUS.read_text()
    except OSError:
        return None, None
    kib = {key: int(rest.split()[0]) for key, _, rest in (line.partition(":") for line in text.splitlines())
           if key in ("VmRSS", "RssAnon")}
    rss, anon = kib.get("VmRSS"), kib.get("RssAnon")
    return None if rss is None else rss * 1024, None if anon is None else anon * 1024


def peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryTrace:
    """[step, rss_bytes, anon_bytes] after each step: the steps that are multiples of `stride` (which doubles,
    dropping every other point, whenever `max_points` are kept; a stride by step number keeps the saving steps
    of a regular checkpoint interval as long as it can) and the latest."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, got {max_points}")
        self.max_points = max_points
        self.stride = 1
        self.kept: list[Point] = []
        self.last: Point | None = None

    def record(self, step: int) -> None:
        """Take this process's memory now, as of `step`."""
        self.last = [step, *rss_now()]
        if step % self.stride == 0:
            self.kept.append(self.last)
        while len(self.kept) >= self.max_points:  # room for the latest point beside them
            self.stride *= 2
            self.kept = [p for p in self.kept if p[0] % self.stride == 0]

    def points(self) -> list[Point]:
        """The kept points in step order, ending with the latest."""
        if self.last is None or (self.kept and self.kept[-1] is self.last):
            return list(self.kept)
        return [*self.kept, self.last]
