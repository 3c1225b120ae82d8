"""Where a process finds the registry: one rule for its URL, and one `Registry` per URL per process.

The URL: an explicit one (a CLI's `--db`), else the job config's `publish.registry_url`, else
$RETRAINER_DB_URL, else the embedded SQLite database `$RETRAINER_HOME/registry.db`. A Registry pools
its connections and checks the schema once, so every stage, verb and page of a process shares the
one of its URL (closed when the process exits) instead of opening an engine per call.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING

from tasks.base.home import retrainer_home

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig
    from tasks.registry import Registry


def registry_url(cfg: JobConfig | None = None, given: str | None = None) -> str:
    """The registry URL by the rule above."""
    if given:
        return given
    if cfg is not None:
        return cfg.publish.registry_url
    return os.environ.get("RETRAINER_DB_URL") or f"sqlite:///{retrainer_home() / 'registry.db'}"


def shown_registry_urls(cfgs: Iterable[JobConfig]) -> list[str]:
    """The registries a view over several jobs reads (the registry page): $RETRAINER_DB_URL when set, one
    database named for all of them, else each job's `publish.registry_url` once."""
    if env_url := os.environ.get("RETRAINER_DB_URL"):
        return [env_url]
    return list(dict.fromkeys(cfg.publish.registry_url for cfg in cfgs))


@cache
def registry_at(url: str) -> Registry:
    """This process's Registry of `url` (made on first use, closed at exit)."""
    from tasks.registry import Registry

    registry = Registry(url)
    atexit.register(registry.close)
    return registry


def registry_for(cfg: JobConfig | None = None, given: str | None = None) -> Registry:
    """This process's Registry of a job (or of an explicit URL, or the default one)."""
    return registry_at(registry_url(cfg, given))
