"""Fair side-by-side figures for the bench/ scripts (issue 38): one sampling method, stated once, used by all.

The method. Each side (ours, and each peer) is sampled at least 3 times; the sides are taken in turn and the
order rotates every round (two sides: ours, theirs | theirs, ours | ours, theirs ...; more: each round starts
one side further along), so that load from other work on a shared box hits every side alike and no side always
runs right after the same other one. A side's figure is the median of its samples, printed with their min, max
and the 1-minute load average at each sample. When any side's samples spread by more than MAX_SPREAD (max /
min), the whole set is taken again (RESAMPLES times at most), not averaged: a median of scattered samples says
more about the box than about the code. A set still scattered after that is printed flagged "NOT a stable
figure". Fairness of resources is each bench's job: a compute peer runs as many threads as our ranks use
together (each bench's docstring says how).

API (a bench runs as `.venv/bin/python bench/X.py`, so bench/ is on sys.path: `from fair import ...`):
- `Sample(value, load, cpu_s=None, extra={})`: one measurement. `value` is seconds unless the bench says
  otherwise (registry.py: switches/s); `load` the 1-minute load average when it started; `cpu_s` the CPU seconds
  it cost; `extra` any other per-sample values (a peak RSS, a second timing, a list of latencies).
- `timed(fn, reset=None) -> Sample`: runs `reset` untimed, then `fn`: wall seconds, the load before it, and the
  CPU seconds of this process (all threads) and of the child processes it reaped meanwhile.
- `timer(fn, reset=None)`: the same as a side for `alternated`.
- `alternated(name, sides, repeat=3) -> dict[str, list[Sample]]`: `sides` maps a side's name to a callable
  returning one Sample (its first entry is taken first in round 1); returns each side's samples of the last set
  taken.
- `median(samples, what="value")`: the median of `value`, `cpu_s`, `load` or a key of `extra`.
- `stats(samples, unit="s", what="value", fmt=".2f", load=True) -> str`: "median unit (min, max; load at each
  sample)", flagged when the samples spread by more than MAX_SPREAD. `spread(samples, what="value")`: max / min.

    from fair import alternated, median, stats, timer
    got = alternated("copy", {"ours": timer(ours, reset), "cp -r": timer(cp, reset)}, repeat=3)
    print(f"copy ours {stats(got['ours'])} | cp -r {stats(got['cp -r'])} | "
          f"ratio {median(got['cp -r']) / median(got['ours']):.2f}")
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_SAMPLES = 3
MAX_SPREAD = 1.5  # a side whose samples spread by more (max / min) is sampled again, not averaged
RESAMPLES = 2  # how many times a scattered set is taken again before it is reported flagged


@dataclass(frozen=True)
class Sample:
    """One measurement of one side (see the module doc)."""

    value: float
    load: float
    cpu_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _cpu_s() -> float:
    """User + system CPU seconds of this process (every thread) and of its reaped children (and theirs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], object], reset: Callable[[], object] | None = None) -> Sample:
    """`reset` untimed (outputs of the last sample removed, caches set), then `fn` timed."""
    if reset is not None:
        reset()
    load, cpu = os.getloadavg()[0], _cpu_s()
    started = time.perf_counter()
    fn()
    return Sample(time.perf_counter() - started, load, _cpu_s() - cpu)


def timer(fn: Callable[[], object], reset: Callable[[], object] | None = None) -> Callable[[], Sample]:
    return lambda: timed(fn, reset)


def _get(sample: Sample, what: str) -> float:
    return getattr(sample, what) if what in ("value", "load", "cpu_s") else sample.extra[what]


def spread(samples: list[Sample], what: str = "value") -> float:
    got = [_get(s, what) for s in samples]
    if min(got) <= 0:
        return 1.0 if max(got) <= 0 else float("inf")
    return max(got) / min(got)


def median(samples: list[Sample], what: str = "value") -> float:
    return statistics.median(_get(s, what) for s in samples)


def alternated(name: str, sides: Mapping[str, Callable[[], Sample]], repeat: int = MIN_SAMPLES
               ) -> dict[str, list[Sample]]:
    """`repeat` (at least MIN_SAMPLES) samples of each side, in rotated order each round; the whole set taken
    again while any side spreads by more than MAX_SPREAD (RESAMPLES times at most). The last set is returned."""
    names = list(sides)
    repeat = max(MIN_SAMPLES, repeat)
    for attempt in range(RESAMPLES + 1):
        got: dict[str, list[Sample]] = {n: [] for n in names}
        for r in range(repeat):
            for n in names[r % len(names):] + names[:r % len(names)]:
                got[n].append(sides[n]())
        scattered = {n: spread(s) for n, s in got.items() if spread(s) > MAX_SPREAD}
        if not scattered:
            return got
        print(f"{name}: samples spread " + ", ".join(f"{n} {x:.2f}x" for n, x in scattered.items())
              + f" (> {MAX_SPREAD}x): "
              + ("taking the set again" if attempt < RESAMPLES else "NOT a stable figure, reported as it is"),
              flush=True)
    return got


def stats(samples: list[Sample], unit: str = "s", what: str = "value", fmt: str = ".2f", load: bool = True) -> str:
    got = [_get(s, what) for s in samples]
    text = f"{statistics.median(got):{fmt}}{unit} (min {min(got):{fmt}}, max {max(got):{fmt}}"
    if load:
        text += "; load " + ", ".join(f"{s.load:.1f}" for s in samples)
    text += ")"
    if spread(samples, what) > MAX_SPREAD:
        text += f" NOT a stable figure (spread {spread(samples, what):.2f}x)"
    return text
