"""One scheduled run of a demo (`retrainer demo`, `retrainer demo --chat`), printed as its person reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig


def run_week(cfg: JobConfig, title: str) -> dict:
    from tasks.stages.lifecycle import describe_outcome, run_lifecycle

    print(f"== {title}", flush=True)
    out = run_lifecycle(cfg)
    for line in describe_outcome(out):
        print(f"   {line}", flush=True)
    return out
