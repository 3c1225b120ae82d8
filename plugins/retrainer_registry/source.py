"""Where the page reads the registry from, which job config owns each model, and what a version's record says.

The registries shown: `tasks.config.endpoints.shown_registry_urls` over the job configs in
$RETRAINER_CONFIG_DIR (default: the project's configs/). The configs also
tell the page which `rollback_model` form value (the job name) moves a given model.
`VersionFacts` picks the numbers a person compares out of a version's recorded metrics
(the evaluate stage's output plus what publish adds: the loss curve and the gate's rules).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrainer_airflow.configs import job_configs

from retrainer_registry.render import number
from tasks.config.endpoints import shown_registry_urls
from tasks.config.schema import JobConfig
from tasks.registry.records import origin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """Registry URLs to show and job configs by the model name they publish."""

    registry_urls: list[str]
    jobs_by_model: dict[str, JobConfig] = field(default_factory=dict)


def load_sources() -> Sources:
    """The configs as they are at this request (each file loaded again only once it changed: a new or edited
    config shows up without a restart)."""
    jobs: dict[str, JobConfig] = {}
    for cfg in job_configs(skip_invalid=True).values():
        jobs.setdefault(cfg.publish.model_name, cfg)
    return Sources(registry_urls=shown_registry_urls(jobs.values()), jobs_by_model=jobs)


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


# The actor the DAGs record on a version and on each alias move: "airflow <dag_id>/<run_id>" (dags/retrain.py,
# dags/rollback.py), after "<person> via " for a run a person triggered or approved (tasks.base.audit.via), possibly
# followed by more words. A DAG id has no "/" or space; the run id has no space.
_DAG_RUN_ACTOR = re.compile(r"^(?:.* via )?airflow ([A-Za-z0-9_.-]+)/(\S+)")


def dag_run_of(actor: str | None) -> tuple[str, str] | None:
    """(dag_id, run_id) of the Airflow run an actor names, or None for a person or a CLI run."""
    match = _DAG_RUN_ACTOR.match(actor or "")
    return (match.group(1), match.group(2)) if match else None


@dataclass(frozen=True)
class VersionFacts:
    """What a version's record says about its quality and origin, as the page compares versions.

    `loss`/`perplexity`/`eval_tokens`: the first evaluation suite's (the held-out numbers every gate
    has); `suite_metrics`: every `<suite>.<metric>` scored; `gate`: each rule with its result as
    recorded at publish; `step`: the checkpoint's training step; `evaluated_live`: the live version's
    numbers on the same suites in the same evaluation (what the gate compared against), if any."""

    version: int
    parent_version: int | None
    started_from: str  # where training started: scratch, pretrained <dir>, version <N>, weights <path>
    loss: float | None
    perplexity: float | None
    eval_tokens: int | None
    step: int | None
    suite_metrics: dict[str, float]
    gate: list[dict[str, Any]]
    evaluated_live: dict[str, Any] | None
    suites: list[dict[str, Any]]
    data_url: str | None
    data_manifest_hash: str
    data_replay: list[dict[str, Any]]
    created_by: str
    created_at: str
    train_losses: list[float]


def version_facts(version: dict[str, Any], job: JobConfig | None) -> VersionFacts:
    """The facts of one `Registry.show()` version (older records lack some: those are None or empty)."""
    m = version.get("metrics") or {}
    suite = m.get("metrics") if isinstance(m.get("metrics"), dict) else {}
    tokens, step = number(m.get("tokens")), number(m.get("step"))
    live = m.get("live") if isinstance(m.get("live"), dict) else None
    return VersionFacts(
        version=int(version["version"]), parent_version=version.get("parent_version"),
        started_from=origin(version.get("started_from"), version.get("parent_version"), version.get("init_digest")),
        loss=number(m.get("loss")), perplexity=number(m.get("perplexity")),
        eval_tokens=None if tokens is None else int(tokens), step=None if step is None else int(step),
        suite_metrics={k: float(v) for k, v in sorted(suite.items()) if number(v) is not None},
        gate=[r for r in m.get("gate") or [] if isinstance(r, dict)],
        evaluated_live=live if live is not None and isinstance(live.get("metrics"), dict) else None,
        suites=[s for s in m.get("suites") or [] if isinstance(s, dict)],
        data_url=version.get("data_url"), data_manifest_hash=str(version.get("data_manifest_hash", "")),
        data_replay=list(version.get("data_replay") or []),
        created_by=str(version.get("created_by", "")), created_at=str(version.get("created_at", "")),
        train_losses=training_losses(version, job),
    )
