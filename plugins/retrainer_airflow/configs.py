"""The job configs the DAGs and the registry page serve, and the Asset alias every alias move is announced on.

The config folder is $RETRAINER_CONFIG_DIR, else the project's configs/ (next to dags/ and plugins/).
Each config file is loaded once per process while it is unchanged (cached by path and mtime): a DAG
processor parsing the four DAG files, or the page answering each request, reads a config once, and
an edited or new config shows up without a restart.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from airflow.sdk import AssetAlias, Param

from tasks.base.errors import ConfigError
from tasks.config.bounds import NAME_PATTERN
from tasks.config.schema import JobConfig
from tasks.models.resolve import load_config

log = logging.getLogger(__name__)

PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# The alias-moved events: a retrain's publish, every rollback and promotion add one; the deploy DAGs are scheduled
# on it.
MODEL_EVENTS = AssetAlias("retrainer-model-alias-moved")

_LOADED: dict[Path, tuple[int, JobConfig]] = {}


def config_dir() -> Path:
    return Path(os.environ.get("RETRAINER_CONFIG_DIR") or PROJECT_CONFIGS)


def config_at(path: Path) -> JobConfig:
    """The config in `path`, loaded once while the file is unchanged; ConfigError as load_config raises it."""
    mtime_ns = path.stat().st_mtime_ns
    cached = _LOADED.get(path)
    if cached is None or cached[0] != mtime_ns:
        cached = _LOADED[path] = (mtime_ns, load_config(path))
    return cached[1]


def job_configs(skip_invalid: bool = False) -> dict[Path, JobConfig]:
    """Every job config of the config folder by file; `skip_invalid` logs and leaves out a config that does
    not load (the page shows the others) where a DAG file lets the error stand (an import error names it)."""
    configs: dict[Path, JobConfig] = {}
    for path in sorted(config_dir().glob("*.yaml")):
        try:
            configs[path] = config_at(path)
        except ConfigError as exc:
            if not skip_invalid:
                raise
            log.warning("skipping config: %s", exc)
    return configs


def configs_by_name() -> dict[str, Path]:
    """Job name -> config file: the models a DAG that acts on a model by name offers (rollback_model, promote_model)."""
    return {cfg.name: path for path, cfg in job_configs().items()}


def alias_params(configs: dict[str, Path], verb: str) -> dict[str, Param]:
    """The form's `model` (one of `configs`) and `alias` fields of a DAG that moves a model's alias by hand."""
    return {
        "model": Param(next(iter(configs), ""), type="string", enum=sorted(configs) or [""],
                       description=f"job name whose published model to {verb}"),
        "alias": Param(None, type=["null", "string"], minLength=1, maxLength=200, pattern=NAME_PATTERN,
                       description="alias to move (default: the config's publish.alias)"),
    }

