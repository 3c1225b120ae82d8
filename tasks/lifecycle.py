"""The lifecycle stages as JSON-in/JSON-out functions, and the whole run chained for the CLI.

The Airflow DAG calls each `stage_*` function from its own task (outputs travel
as XCom), and `retrainer run` / `retrainer demo` chain the same functions in one
process. Each stage receives the previous stage's output by value, never by
reaching into another stage's internals.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from tasks.config import JobConfig, load_config
from tasks.errors import PlanDoesNotFitError
from tasks.gate import decide
from tasks.lock import default_holder, experiment_lock

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt.yaml"


def resolve_config(config_path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load a job config and apply run-time overrides (from a CLI flag or a DAG Param), validated."""
    cfg = load_config(config_path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    return cfg.with_overrides(overrides) if overrides else cfg


# Manual-run Params (the Airflow form) -> dotted config overrides.
PARAM_OVERRIDES = {
    "steps": "train.steps",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp": "parallel.dp",
    "micro_batches": "parallel.micro_batches",
    "alias": "publish.alias",
}


def overrides_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """Map a manual run's form values onto config fields; unset (None) values keep the config's."""
    return {field: params[name] for name, field in PARAM_OVERRIDES.items() if params.get(name) is not None}


def known_configs(config_dir: str | Path) -> dict[str, Path]:
    """Every job config in a folder, by job name (the DAG factory and the rollback form use this)."""
    return {load_config(path).name: path for path in sorted(Path(config_dir).glob("*.yaml"))}


def run_config(cfg: JobConfig) -> JobConfig:
    """The config a training run uses: its output dir is keyed by the experiment, so retries resume
    and a different experiment never picks up another's checkpoints."""
    run_dir = Path(cfg.train.output_dir) / cfg.experiment_key()[:16]
    return cfg.with_overrides({"train.output_dir": str(run_dir)})


def stage_plan(cfg: JobConfig, *, force: bool = False) -> dict[str, Any]:
    from tasks.plan import plan

    result = plan(cfg)
    log.info("plan: %s", result.verdict)
    for warning in result.warnings:
        log.warning("plan: %s", warning)
    if not result.fits:
        if not force:
            raise PlanDoesNotFitError(f"plan: {result.verdict} (force to launch anyway)")
        log.warning("plan says the launch cannot work; launching anyway because force is set")
    return result.to_dict()


def stage_warm(cfg: JobConfig) -> dict[str, Any]:
    from tasks.warm import warm_for_config

    result = warm_for_config(cfg)
    return {
        "dataset_dir": str(result.dataset_dir),
        "manifest_hash": result.manifest_hash,
        "report": result.report.to_dict(),
    }


def stage_train(cfg: JobConfig, warm: dict[str, Any], *, holder: str | None = None) -> dict[str, Any]:
    from tasks.launch import get_launcher

    with experiment_lock(cfg.publish.registry_url, cfg.experiment_key(), holder or default_holder("cli")):
        return get_launcher(cfg).run(run_config(cfg), Path(warm["dataset_dir"]))


def stage_evaluate(cfg: JobConfig, summary: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    from tasks.evaluate import evaluate

    metrics = evaluate(cfg, Path(summary["checkpoint_dir"]), Path(warm["dataset_dir"]))
    log.info("evaluate: held-out loss %.4f, perplexity %.2f", metrics["loss"], metrics["perplexity"])
    return metrics


def registry_for(cfg: JobConfig):
    """The registry of a job, its schema brought up to date first (idempotent, cheap)."""
    from tasks.registry import Registry, upgrade

    upgrade(cfg.publish.registry_url)
    return Registry(cfg.publish.registry_url)


def _live_loss(cfg: JobConfig, warm: dict[str, Any]) -> tuple[float | None, int | None]:
    """The live model's held-out loss on *this* run's held-out data (re-evaluated if the data changed)."""
    from tasks.evaluate import evaluate_weights
    from tasks.registry import ArtifactStore

    live = registry_for(cfg).live_version(cfg.publish.model_name, cfg.publish.alias)
    if live is None:
        return None, None
    if live.data_manifest_hash == warm["manifest_hash"] and "loss" in (live.metrics or {}):
        return float(live.metrics["loss"]), live.version
    store = ArtifactStore(cfg.publish.store_url, cfg.publish.storage_options)
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.pt"
        store.get(live.artifact_digest, weights)
        metrics = evaluate_weights(cfg, weights, Path(warm["dataset_dir"]))
    return float(metrics["loss"]), live.version


def stage_gate(cfg: JobConfig, metrics: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    live_loss, live_version = _live_loss(cfg, warm)
    decision = decide(float(metrics["loss"]), live_loss, cfg.evaluate.gate.tolerance, live_version)
    (log.info if decision.publish else log.warning)("gate: %s", decision.reason)
    return decision.to_dict()


def loss_curve(losses: list[float], max_points: int = 1000) -> list[float]:
    """The training loss curve kept with a version (the registry page draws it), thinned to a bounded size."""
    stride = max(1, -(-len(losses) // max_points))
    return [float(x) for x in losses[::stride]]


def stage_publish(
    cfg: JobConfig,
    summary: dict[str, Any],
    metrics: dict[str, Any],
    warm: dict[str, Any],
    *,
    actor: str | None = None,
    reason: str = "retrain",
) -> dict[str, Any]:
    from tasks.plan import serving_estimate
    from tasks.publish import publish

    serving = serving_estimate(cfg)
    result = publish(
        cfg,
        Path(summary["checkpoint_dir"]),
        {**metrics, "train_losses": loss_curve(summary.get("losses", []))},
        data_manifest_hash=warm["manifest_hash"],
        serving_bytes=int(serving["serving_bytes"]),
        actor=actor or default_holder(),
        reason=reason,
    )
    out = result.to_dict()
    log.info("publish: %s v%s is now %s (artifact %s)", out["model"], out["version"], out["alias"],
             out["artifact_url"])
    return out


def stage_rollback(
    cfg: JobConfig, *, alias: str | None = None, to_version: int | None = None,
    actor: str | None = None, reason: str = "rollback",
) -> dict[str, Any]:
    """Move the alias back (to the version live before the current one, or to `to_version`), audited."""
    record = registry_for(cfg).rollback(
        cfg.publish.model_name, alias or cfg.publish.alias, to=to_version,
        actor=actor or default_holder(), reason=reason,
    )
    out = record.to_dict()
    log.info("rollback: %s/%s moved v%s -> v%s", cfg.publish.model_name, out["alias"],
             out["from_version"], out["to_version"])
    return out


def run_lifecycle(cfg: JobConfig, *, force: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """plan -> warm -> train -> evaluate -> gate -> publish, in one process."""
    out: dict[str, Any] = {"experiment_key": cfg.experiment_key()}
    out["plan"] = stage_plan(cfg, force=force)
    out["warm"] = stage_warm(cfg)
    if dry_run:
        return out
    out["train"] = stage_train(cfg, out["warm"])
    out["evaluate"] = stage_evaluate(cfg, out["train"], out["warm"])
    out["gate"] = stage_gate(cfg, out["evaluate"], out["warm"])
    if out["gate"]["publish"]:
        out["publish"] = stage_publish(cfg, out["train"], out["evaluate"], out["warm"])
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config, {"train.steps": args.steps})
    out = run_lifecycle(cfg, force=args.force, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_outcome(out)
    return 0


def _print_outcome(out: dict[str, Any]) -> None:
    if "publish" in out:
        pub = out["publish"]
        print(f"published {pub['model']} v{pub['version']} -> alias {pub['alias']!r}: {pub['artifact_url']}")
    elif "gate" in out:
        print(f"not published: {out['gate']['reason']}")
    else:
        print(f"dry run: planned and warmed {out['warm']['dataset_dir']}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the whole lifecycle for one config in this process")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--force", action="store_true", help="launch even if the plan says it cannot fit")
    p.add_argument("--dry-run", action="store_true", help="plan and warm only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_run)
