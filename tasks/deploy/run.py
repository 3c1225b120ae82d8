"""The whole deploy in one process (`retrainer deploy`): resolve, pull, smoke test, hook; rolled back on a failure."""

from __future__ import annotations

from typing import Any

from tasks.config.schema import JobConfig
from tasks.deploy.check import smoke_test
from tasks.deploy.handoff import run_hook
from tasks.deploy.pull import pull
from tasks.deploy.rollback import failure_reason, roll_back
from tasks.deploy.target import DeployError, resolve_target


def run_deploy(cfg: JobConfig, *, actor: str, event_extras: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """resolve -> pull -> smoke test -> hook, rolling the alias back on a failure (then DeployError)."""
    target, step = None, "pull"
    out: dict[str, Any] = {}
    try:
        target = resolve_target(cfg, event_extras)
        out["target"] = target.to_dict()
        pull(cfg, target)
        step = "smoke test"
        out["smoke_test"] = smoke_test(cfg, target)
        step = "hook"
        out["hook"] = run_hook(cfg, target)
    except Exception as exc:
        failure = failure_reason(exc, step)
        rolled = roll_back(cfg, target, failure, actor=actor)
        raise DeployError(f"{failure}; rolled {rolled.alias} back v{rolled.from_version} -> "
                          f"v{rolled.to_version}") from exc
    return out
