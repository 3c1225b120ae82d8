"""Where the page reads the registry from, and which job config owns each model.

The registry URL is $RETRAINER_DB_URL, else the `publish.registry_url` of the job
configs in $RETRAINER_CONFIG_DIR (default: the project's configs/). The configs also
tell the page which `rollback_model` form value (the job name) moves a given model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import ConfigError, JobConfig, load_config

log = logging.getLogger(__name__)

PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class Sources:
    """Registry URLs to show and job configs by the model name they publish."""

    registry_urls: list[str]
    jobs_by_model: dict[str, JobConfig] = field(default_factory=dict)


def config_dir() -> Path:
    return Path(os.environ.get("RETRAINER_CONFIG_DIR") or PROJECT_CONFIGS)


def load_sources() -> Sources:
    """Read the configs each request (cheap; a new config shows up without a restart)."""
    jobs: dict[str, JobConfig] = {}
    for path in sorted(config_dir().glob("*.yaml")):
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            log.warning("registry page: skipping config: %s", exc)
            continue
        jobs.setdefault(cfg.publish.model_name, cfg)
    if env_url := os.environ.get("RETRAINER_DB_URL"):
        urls = [env_url]
    else:
        urls = list(dict.fromkeys(cfg.publish.registry_url for cfg in jobs.values()))
    return Sources(registry_urls=urls, jobs_by_model=jobs)


def training_losses(version: dict[str, Any], job: JobConfig | None) -> list[float]:
    """The training loss curve of a version.

    Preferred: carried in the version's metrics (`train_losses` or `losses`). Otherwise the
    run's summary.json, found where the lifecycle writes it (`<train.output_dir>/<experiment
    key[:16]>/summary.json`), used only if its experiment key is the version's config hash.
    """
    metrics = version.get("metrics") or {}
    for key in ("train_losses", "losses"):
        if isinstance(metrics.get(key), list):
            return [float(x) for x in metrics[key]]
    if job is None:
        return []
    key = str(version.get("config_hash", ""))
    summary_path = Path(job.train.output_dir) / key[:16] / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return []
    if summary.get("experiment_key") != key or not isinstance(summary.get("losses"), list):
        return []
    return [float(x) for x in summary["losses"]]
