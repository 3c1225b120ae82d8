"""Preflight planner: memory and communication budget of a launch, verdict, layout search.

`plan(cfg)` refuses doomed launches, and layouts the cluster cannot run, before any data
is warmed or GPU is held; `search(cfg, gpus)` ranks layouts that fit; `serving_estimate`
sizes the published model for serving (the config's `serving` section); `retrainer plan` is tasks/cli/plan.py.
"""

from __future__ import annotations

from tasks.plan.budget import Memory, Plan, Step, plan, resolve_precision
from tasks.plan.layout import validate_layout
from tasks.plan.search import search
from tasks.plan.serving import serving_estimate

__all__ = [
    "Memory",
    "Plan",
    "Step",
    "plan",
    "resolve_precision",
    "search",
    "serving_estimate",
    "validate_layout",
]
