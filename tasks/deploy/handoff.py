"""Handing a verified, smoke-tested version to the user's hook (`deploy.command` or `deploy.entry_point`), in a
process of its own, the version in `RETRAINER_DEPLOY_*` environment variables (never on a command line)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from tasks.config.schema import JobConfig
from tasks.deploy.process import died, run_logged
from tasks.deploy.target import ENV_PREFIX, DeployError, DeployTarget

log = logging.getLogger(__name__)

# The hook command travels in the environment, not on the command line (where `ps` would show whatever its
# ${VAR}s expanded to), and is unset before it runs.
_RUN_COMMAND = f'cmd=${ENV_PREFIX}COMMAND; unset {ENV_PREFIX}COMMAND; eval "$cmd"'


def run_hook(cfg: JobConfig, target: DeployTarget) -> dict[str, Any]:
    """Hand the verified, smoke-tested version to the user's hook, in a process of its own."""
    d = cfg.deploy
    env = {**os.environ, **target.env()}
    if d.command is not None:
        argv, what = ["/bin/bash", "-c", _RUN_COMMAND], "deploy.command"
        env[f"{ENV_PREFIX}COMMAND"] = d.command
    else:
        assert d.entry_point is not None
        argv, what = [sys.executable, "-m", "tasks.deploy", d.entry_point], f"deploy.entry_point {d.entry_point}"
    started = time.monotonic()
    rc, tail = run_logged(argv, env=env, timeout_s=d.hook_timeout_s, what="hook")
    if rc != 0:
        raise DeployError(f"hook failed: {what} for v{target.version}: {died(rc, tail, d.hook_timeout_s)}")
    log.info("deploy: hook deployed %s v%d (%s) in %.1f s", target.model, target.version, what,
             time.monotonic() - started)
    return {"version": target.version, "hook": what, "seconds": round(time.monotonic() - started, 3)}
