"""The lifecycle stages as typed functions, and the whole run chained for the CLI.

The Airflow DAG calls each `stage_*` function from its own task (outputs travel as XCom: each result's
`to_xcom`/`from_xcom`, called only by the Airflow plugin), and `retrainer run` / `retrainer demo` chain the
same functions in one process. Each stage receives the previous stage's result (a frozen dataclass: Planned,
Warmed, Trained, Evaluated, GateDecision, PublishResult) by value, never by reaching into another stage's
internals.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.audit import default_actor
from tasks.base.errors import InvalidInputError, PlanDoesNotFitError, RetrainerError
from tasks.base.lock import default_holder, experiment_lock
from tasks.base.policy import Person, check_mover
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.data.sources import refuse_cached, suite_sources, training_sources
from tasks.data.warm import remote_manifest_hash
from tasks.inputs.adapter import weights_to_load
from tasks.inputs.start import resolve_identity
from tasks.inputs.weights import fetch_starting_weights, weights_path
from tasks.models.resolve import ConfigSnapshot
from tasks.runs.identity import RunIdentity, claim_run_dir, nothing_new
from tasks.stages.gate import GateDecision, judge, known_candidate, rolled_back_reason
from tasks.stages.publish import PublishResult, require_approval

if TYPE_CHECKING:
    from tasks.evaluate import Evaluated
    from tasks.launch import Launch, Outcome
    from tasks.plan import Plan
    from tasks.registry import SwitchRecord
    from tasks.stages.housekeeping import Pruned

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Planned:
    """What a run's plan stage froze for every later stage: the resolved config, who the run is, its budget,
    and why it stops before training (None: it trains)."""

    job: ConfigSnapshot
    run: RunIdentity
    budget: Plan
    skip: str | None

    def config(self) -> JobConfig:
        return self.job.config()

    def to_xcom(self) -> dict[str, Any]:
        return {"job": self.job.to_dict(), "run": self.run.to_dict(), "budget": self.budget.to_dict(),
                "skip": self.skip}

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Planned:
        from tasks.plan import Plan

        return cls(ConfigSnapshot.from_dict(data["job"]), RunIdentity.from_dict(data["run"]),
                   Plan.from_dict(data["budget"]), data["skip"])


@dataclass(frozen=True)
class Warmed:
    """The run's data on this cluster: the primary source's dataset directory and manifest, and each replay
    source's warm (JSON as the warm reported it: only read to show it)."""

    dataset_dir: Path
    manifest_hash: str
    report: dict[str, Any]
    replay: tuple[dict[str, Any], ...]

    def to_xcom(self) -> dict[str, Any]:
        return {"dataset_dir": str(self.dataset_dir), "manifest_hash": self.manifest_hash, "report": self.report,
                "replay": list(self.replay)}

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Warmed:
        return cls(Path(data["dataset_dir"]), data["manifest_hash"], data["report"], tuple(data["replay"]))


@dataclass(frozen=True)
class Trained:
    """The run's finished training: how it got there (`outcome`: trained, resumed, reused), its final
    checkpoint, the ranks' staged export, and the loss curve; `summary` keeps the rest of what the ranks
    reported (layout, telemetry, saves), shown, never read by a later stage."""

    outcome: str
    checkpoint_dir: Path
    checkpoint_tag: str
    trained_steps: int
    resumed_from_step: int | None
    first_loss: float | None
    final_loss: float | None
    losses: tuple[float, ...]
    export: dict[str, Any] | None
    summary: dict[str, Any]

    @classmethod
    def of(cls, summary: dict[str, Any], outcome: str, **changes: Any) -> Trained:
        """From the ranks' summary (summary.json) of the run's training."""
        return cls.from_xcom({**summary, "outcome": outcome, **changes})

    def to_xcom(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "summary"}
        return {**self.summary, **fields, "checkpoint_dir": str(self.checkpoint_dir), "losses": list(self.losses)}

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Trained:
        typed = {f.name for f in dataclasses.fields(cls)} - {"summary"}
        return cls(outcome=data["outcome"], checkpoint_dir=Path(data["checkpoint_dir"]),
                   checkpoint_tag=data["checkpoint_tag"], trained_steps=data["trained_steps"],
                   resumed_from_step=data.get("resumed_from_step"), first_loss=data.get("first_loss"),
                   final_loss=data.get("final_loss"), losses=tuple(data.get("losses", ())),
                   export=data.get("export"), summary={k: v for k, v in data.items() if k not in typed})


def stage_plan_run(job: ConfigSnapshot, *, force: bool = False) -> Planned:
    """identify + plan: the run frozen (config, data, starting weights) and whether it trains at all."""
    cfg = job.config()
    run = stage_identify(cfg)
    budget = stage_plan(cfg, run, force=force)
    return Planned(job, run, budget, refused_before_training(cfg, run))


def stage_identify(cfg: JobConfig) -> RunIdentity:
    """Who this run is: the defining config, the data as it is now, the starting weights as they are now."""
    run = resolve_identity(cfg, registry_for(cfg))
    log.info("run %s: starts from %s; data %s (manifest %s)", run.run_id, run.init.note, run.data_url,
             run.data_manifest_hash[:12])
    return run


def refused_before_training(cfg: JobConfig, run: RunIdentity) -> str | None:
    """Why this run stops before warm, train and evaluate, as its note says it, else None: no new data
    (`nothing_new`), or its result is known already and the gate would refuse it. Same experiment key =
    same result: a run whose key and final checkpoint are a version rolled back from the run's alias
    would train (or reuse) that version, evaluate it, and only then be refused; it is refused here."""
    if (reason := nothing_new(run)) is not None:
        return reason
    from tasks.train.checkpoint import tag_for

    model, alias = cfg.publish.model_name, cfg.publish.alias
    registry = registry_for(cfg)
    candidate = registry.find_version(model, run.experiment_key, tag_for(cfg.train.steps))
    back = None if candidate is None else registry.rollbacks(model, alias).get(candidate.version)
    if candidate is None or back is None:
        return None
    return f"gate: {rolled_back_reason(model, alias, candidate.version, back)}"


def stage_plan(cfg: JobConfig, run: RunIdentity, *, force: bool = False) -> Plan:
    """The run's memory and communication budget; a launch that cannot fit, or a fresh run that would start
    over beside a stopped run of another global batch (tasks/train/other_batch.py), is refused unless forced.
    Data this machine has cached already that the model cannot read is refused whatever `force` says."""
    from tasks.plan import plan
    from tasks.plan.render import shortfall
    from tasks.train.other_batch import stopped_at_another_batch

    refuse_cached_data(cfg, run)

    if (lost := stopped_at_another_batch(cfg, run)) is not None:
        if not force:
            raise InvalidInputError(lost)
        log.warning("plan: %s; starting the new run anyway because force is set", lost)
    from tasks.data.sources import planned_data

    result = plan(cfg, data=planned_data(cfg))
    log.info("plan: %s", result.verdict)
    for warning in result.warnings:
        log.warning("plan: %s", warning)
    if not result.fits:
        if not force:
            raise PlanDoesNotFitError(f"plan: {result.verdict}: {shortfall(result)} (force to launch anyway)")
        log.warning("plan says the launch cannot work; launching anyway because force is set")
    return result


def refuse_cached_data(cfg: JobConfig, run: RunIdentity) -> None:
    """Every dataset the run reads (its data and replay sources as identified, each suite's as it is now) that
    this machine's cache holds already is checked from its record against the model, before anything is
    warmed or any rank starts (tasks/data/sources.py)."""
    hashes = [run.data_manifest_hash, *(r.manifest_hash for r in run.replay)]
    planned = list(zip(training_sources(cfg), hashes, strict=True))
    planned += [(s, remote_manifest_hash(s.source_url, s.manifest, s.storage_options)) for s in suite_sources(cfg)]
    refuse_cached(cfg, planned)


def stage_warm(cfg: JobConfig, run: RunIdentity) -> Warmed:
    """Warm the starting weights the ranks load (checked as they enter the cache: before a run directory
    exists; on a launcher that warms each node, each node's warm does this instead) and every source of the
    run's data (the primary, then each replay source), each verified against the manifest the run was
    identified with."""
    from tasks.data.warm import warm_mixture
    from tasks.launch import get_launcher

    if not get_launcher(cfg).warms_nodes:
        fetch_starting_weights(cfg, weights_to_load(cfg, run))
    primary, *replay = warm_mixture(cfg)
    planned = [(run.data_url, run.data_manifest_hash), *((r.url, r.manifest_hash) for r in run.replay)]
    for (url, then), result in zip(planned, [primary, *replay], strict=True):
        if result.manifest_hash != then:
            raise RetrainerError(
                f"{url}: the dataset changed since this run started (manifest "
                f"{then[:12]} then, {result.manifest_hash[:12]} now); a new run trains on it")
    return Warmed(primary.dataset_dir, primary.manifest_hash, primary.report.to_dict(),
                  tuple({"url": url, **result.to_dict()} for (url, _), result in zip(planned[1:], replay, strict=True)))


def stage_train(cfg: JobConfig, run: RunIdentity, warm: Warmed, *, holder: str | None = None) -> Trained:
    """Train this run in its own directory; a finished run of the same key is reused, a killed one resumed."""
    with _train_lock(cfg, run, holder):
        done = _finished(cfg, run)
        if done is not None:
            return done
        summary = _train_launch(cfg, run, warm).run_here()
    return _trained(run, summary)


def stage_train_submit(cfg: JobConfig, run: RunIdentity, warm: Warmed, *,
                       holder: str | None = None) -> Trained | dict[str, Any]:
    """`stage_train` for a job that outlives the caller (an Airflow task that defers): the stage's result when
    the run has finished already, else the submitted job's handle (JSON) to follow (tasks.launch.follow) and
    hand to `stage_train_collect`. The experiment lock is held while submitting;
    while the job runs the engine holds the run (one job name per run: a later attempt cancels a job an
    earlier one left before starting its own)."""
    with _train_lock(cfg, run, holder):
        done = _finished(cfg, run)
        if done is not None:
            return done
        return _train_launch(cfg, run, warm).submit()


def stage_train_collect(cfg: JobConfig, run: RunIdentity, warm: Warmed, job: dict[str, Any],
                        outcome: Outcome, *, holder: str | None = None) -> Trained | dict[str, Any]:
    """The trained run from its followed job's outcome; a job the cluster took away is submitted again and
    resumes from its last checkpoint (its new handle), as long as each attempt gets further than the one
    before."""
    from tasks.base.errors import TrainingFailedError
    from tasks.launch import JobPreempted, collect

    try:
        summary = collect(cfg, job, outcome)
    except JobPreempted as exc:
        step = outcome.last_step or 0
        if job.get("preempted_at_step") is not None and step <= job["preempted_at_step"]:
            raise TrainingFailedError(f"{exc}, again without passing step {job['preempted_at_step']}: not "
                                      "submitting it a third time") from None
        log.warning("train: %s: submitting it again; it resumes from its last checkpoint", exc)
        again = stage_train_submit(cfg, run, warm, holder=holder)
        if isinstance(again, Trained):
            return again
        return {**again, "preempted_at_step": step, "preemptions": job.get("preemptions", 0) + 1,
                "deadline": job.get("deadline")}
    return _trained(run, summary)


def _train_lock(cfg: JobConfig, run: RunIdentity, holder: str | None):
    """The run's directory claimed for its key, and the experiment lock held (a context manager)."""
    run_dir = run.run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(run_dir, run)
    return experiment_lock(cfg.publish.registry_url, run.experiment_key, holder or default_holder("cli"))


def _finished(cfg: JobConfig, run: RunIdentity) -> Trained | None:
    """The stage's output of this run's finished training, if it has one (then nothing trains)."""
    from tasks.train.checkpoint import finished_summary

    done = finished_summary(run.run_dir(cfg), run, cfg.train.steps)
    if done is None:
        return None
    log.info("train: run %s already finished (%s): reusing it, no training", run.run_id, done["checkpoint_tag"])
    return Trained.of(done, "reused", trained_steps=0)


def _train_launch(cfg: JobConfig, run: RunIdentity, warm: Warmed) -> Launch:
    from tasks.launch import JobSpec, Launch, LaunchOptions, get_launcher

    # Where the nodes' own warm puts the starting weights (and a continued adapter); a launcher on this machine
    # fetches them here.
    init_path = (weights_path(weights_to_load(cfg, run), cfg.data.cache_dir) if get_launcher(cfg).warms_nodes
                 else fetch_start_here(cfg, run, run.run_dir(cfg)))
    # A LoRA run's artifacts (the adapter, or the merged model) are written by publish from the checkpoint.
    export, secret_env = export_spec(cfg) if cfg.train.lora is None else (None, {})
    return Launch(cfg, JobSpec(run.run_id, run.run_dir(cfg)), warm.dataset_dir, run,
                  LaunchOptions(init_path=init_path, node_warm=True, export=export, secret_env=secret_env))


def fetch_start_here(cfg: JobConfig, run: RunIdentity, job_dir: Path) -> Path | None:
    """What the ranks of a fresh start load, fetched onto this machine: the starting weights into
    `data.cache_dir` (checked as they enter it, once) and, for a LoRA run that continues a version's adapter,
    that adapter staged in `job_dir`, where the ranks read it after loading the base (tasks/inputs/adapter.py).
    The weights' local path (None: scratch). `retrainer run` and `retrainer train` both start here; on
    launchers that warm each node, each node's warm fetches both instead (tasks/inputs/node.py)."""
    from tasks.inputs.adapter import continues_adapter, stage_start_adapter

    if cfg.train.lora is not None and continues_adapter(run.init, run.base):
        stage_start_adapter(cfg, run.init, job_dir)
    return fetch_starting_weights(cfg, weights_to_load(cfg, run))


def _trained(run: RunIdentity, summary: dict[str, Any]) -> Trained:
    trained = Trained.of(summary, "resumed" if summary.get("resumed_from_step") else "trained")
    log.info("train: %s %d steps from %s", trained.outcome, trained.trained_steps, run.init.note)
    return trained


def export_spec(cfg: JobConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """Where the ranks write the final weights' export (a fresh staging area of the artifact store), and the
    store's credentials as the environment variables that carry them to the ranks."""
    from tasks.base.credentials import split_credentials
    from tasks.registry import ArtifactStore

    pub = cfg.publish
    public, secret_env = split_credentials(pub.storage_options, "publish.storage_options")
    staging = ArtifactStore(pub.store_url, pub.storage_options).stage()
    return {"store_url": pub.store_url, "staging": staging, "dtype": pub.export_dtype,
            "storage_options": public}, secret_env


def stage_evaluate(cfg: JobConfig, run: RunIdentity, trained: Trained, warm: Warmed) -> Evaluated:
    """Score the run's checkpoint and the live model on every suite, as rank jobs on the cluster."""
    launch, pending = _evaluation_launch(cfg, run, trained, warm)
    return _evaluated(cfg, pending, launch.run_here())


def stage_evaluate_submit(cfg: JobConfig, run: RunIdentity, trained: Trained, warm: Warmed) -> dict[str, Any]:
    """`stage_evaluate` for a job that outlives the caller: its handle (JSON) for `stage_evaluate_collect`."""
    launch, pending = _evaluation_launch(cfg, run, trained, warm)
    return {**launch.submit(), "pending": pending}


def stage_evaluate_collect(cfg: JobConfig, job: dict[str, Any], outcome: Outcome) -> Evaluated:
    """The evaluation's metrics from its followed job's outcome."""
    from tasks.launch import collect

    return _evaluated(cfg, job["pending"], collect(cfg, job, outcome))


def _evaluation_launch(cfg: JobConfig, run: RunIdentity, trained: Trained, warm: Warmed):
    from tasks.evaluate import evaluation_launch

    live = registry_for(cfg).live_version(cfg.publish.model_name, cfg.publish.alias)
    return evaluation_launch(cfg, run, trained.checkpoint_dir, warm.dataset_dir, run.run_dir(cfg), live=live)


def _evaluated(cfg: JobConfig, pending: dict[str, Any], summary: dict[str, Any]) -> Evaluated:
    from tasks.evaluate import evaluation_result
    from tasks.stages.tracking import record_evaluation

    metrics = evaluation_result(cfg, pending, summary)
    log.info("evaluate: %s", ", ".join(f"{k} {v:.4f}" for k, v in metrics.metrics.items()))
    record_evaluation(cfg, metrics)
    if metrics.live is not None:
        log.info("evaluate: live v%d (%s): %s", metrics.live.version,
                 "cached" if metrics.live.cached else "scored in this job",
                 ", ".join(f"{k} {v:.4f}" for k, v in metrics.live.metrics.items()))
    return metrics


def _live_metrics(cfg: JobConfig, live: Any, metrics: Evaluated) -> dict[str, float] | None:
    """The live version's numbers on this evaluation's suites: scored by the evaluate stage, or cached."""
    from tasks.evaluate.cache import read_cached

    if metrics.live is not None and metrics.live.version == live.version:
        return metrics.live.metrics
    return read_cached(cfg, live.version, metrics.suite_hash)


def stage_gate(cfg: JobConfig, run: RunIdentity, metrics: Evaluated) -> GateDecision:
    model, alias = cfg.publish.model_name, cfg.publish.alias
    registry = registry_for(cfg)
    live = registry.live_version(model, alias)
    candidate = registry.find_version(model, run.experiment_key, metrics.checkpoint_tag)
    new_loss = float(metrics.loss)
    decision = known_candidate(model, alias, new_loss, candidate, live, registry.rollbacks(model, alias))
    if decision is None:
        live_metrics = None if live is None else _live_metrics(cfg, live, metrics)
        if live is not None and live_metrics is None:
            seen = metrics.live
            decision = GateDecision(False, f"the live model of {alias} is v{live.version} now, evaluate scored "
                                    f"{'v' + str(seen.version) if seen else 'no live model'}: not published "
                                    "(run evaluate again)", new_loss, None, live.version)
        else:
            decision = judge(cfg.evaluate.rules(), metrics.metrics, live_metrics,
                             live.version if live else None, f"{cfg.evaluate.suites[0].name}.loss")
    (log.info if decision.publish else log.warning)("gate: %s", decision.reason)
    return decision


def stage_approval_request(cfg: JobConfig, run: RunIdentity, metrics: Evaluated,
                           gate: GateDecision) -> dict[str, str]:
    """What a person reads before approving this run's publish: subject and markdown body, with the version
    live on the run's alias now."""
    from tasks.stages.approval import request_body, request_subject

    model, alias = cfg.publish.model_name, cfg.publish.alias
    live = registry_for(cfg).live_version(model, alias)
    return {"subject": request_subject(model, alias),
            "body": request_body(model, alias, run, dataclasses.asdict(metrics), dataclasses.asdict(gate), live,
                                 cfg.publish.approval_timeout_s)}


def loss_curve(losses: list[float], max_points: int = 1000) -> list[float]:
    """The training loss curve kept with a version (the registry page draws it), thinned to a bounded size."""
    stride = max(1, -(-len(losses) // max_points))
    return [float(x) for x in losses[::stride]]


def stage_publish(
    cfg: JobConfig,
    run: RunIdentity,
    trained: Trained,
    metrics: Evaluated,
    *,
    gate: GateDecision | None = None,
    actor: str | None = None,
    reason: str = "retrain",
    approved_by: str | None = None,
) -> PublishResult:
    """Publish the run's export as a version (with its metrics, the gate's rule results and its MLflow run, when
    there is one) and switch the alias; the version's numbers on these suites are cached (it was scored exactly as
    exported), and the MLflow run is tagged with the version."""
    from tasks.evaluate.cache import write_cached
    from tasks.plan import serving_estimate
    from tasks.stages.publish import publish
    from tasks.stages.tracking import mlflow_run, tag_version, version_link

    serving = serving_estimate(cfg)
    tracked = mlflow_run(cfg, run.experiment_key)
    result = publish(
        cfg,
        trained.checkpoint_dir,
        {**dataclasses.asdict(metrics), "train_losses": loss_curve(list(trained.losses)),
         "gate": list(gate.rules) if gate else [], **version_link(tracked)},
        experiment_key=run.experiment_key,
        serving_bytes=int(serving["serving_bytes"]),
        actor=actor or default_actor(),
        reason=reason,
        staged=trained.export,
        judged_live=gate.live_version if gate else ...,
        approved_by=approved_by,
    )
    write_cached(cfg, result.version, metrics.suite_hash, metrics.metrics)
    tag_version(tracked, result)
    log.info("publish: %s (artifact %s)", publish_note(result), result.artifact_url)
    return result


def publish_note(published: PublishResult) -> str:
    """One line on a publish (its log, the run's note): the version, where its training started, the alias."""
    verb = "published" if published.switched else "already live:"
    return (f"{verb} {published.model} v{published.version} (from {published.started_from}) -> alias "
            f"{published.alias!r}")


def stage_housekeeping(cfg: JobConfig, run: RunIdentity, published: PublishResult) -> Pruned:
    """Once the alias points at the published version: its run's other checkpoints go (locally and in the
    mirror), the one it came from stays (`retention.prune_checkpoints`; tasks/stages/housekeeping.py). A deletion
    that fails is logged, never raised: the publish stands, and `retrainer gc` reclaims what is left."""
    from tasks.stages.housekeeping import Pruned, prune_published

    if not cfg.retention.prune_checkpoints:
        return Pruned()
    label = f"{published.model} v{published.version}"
    record = registry_for(cfg).get_version(published.model, published.version)
    tag = record.checkpoint_tag if record.config_hash == run.experiment_key else None
    try:
        items = prune_published(cfg, run, tag, label)
    except (OSError, RetrainerError) as exc:
        log.warning("housekeeping: pruning run %s after %s failed (retrainer gc will reclaim it): %s", run.run_id,
                    label, exc)
        return Pruned(error=str(exc))
    return Pruned(tuple(items))


def stage_rollback(
    cfg: JobConfig, *, alias: str | None = None, to_version: int | None = None,
    actor: str | None = None, reason: str = "rollback", expect: int | None = None, force: bool = False,
    mover: Person | None = None,
) -> SwitchRecord:
    """Move the alias back (to the newest version live before the current one that was not rolled back from it,
    or to `to_version`: one that was needs `force`; one it never held is refused, being a promotion), audited;
    with `expect`, only if the alias still points to that version (ConflictError otherwise). `mover`: the
    person asking (Airflow knows who), refused unless the alias's `movers` admit them; None where no person
    is known (a command line holding the registry's credentials; a failed deploy's automatic rollback)."""
    from tasks.registry import ANY

    alias = alias or cfg.publish.alias
    if mover is not None:
        check_mover(cfg.publish.policy_for(alias), alias, mover, "roll back")
    record = registry_for(cfg).rollback(
        cfg.publish.model_name, alias, to=to_version,
        actor=actor or default_actor(), reason=reason, expect=ANY if expect is None else expect, force=force,
    )
    log.info("rollback: %s/%s moved v%s -> v%s", cfg.publish.model_name, record.alias, record.from_version,
             record.to_version)
    return record


def run_lifecycle(cfg: JobConfig, *, force: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """identify -> plan -> warm -> train -> evaluate -> gate -> publish -> housekeeping, in one process; the
    report `retrainer run --json` prints: each stage's result in the JSON form its XCom has."""
    if not dry_run:  # a person approves under Airflow: here nobody could, so train nothing that cannot be published
        require_approval(cfg, None)
    run = stage_identify(cfg)
    out: dict[str, Any] = {"experiment_key": run.experiment_key, "run": run.to_dict()}
    if (reason := refused_before_training(cfg, run)) is not None:
        log.info("run %s: %s", run.run_id, reason)
        out["skipped"] = reason
        return out
    out["plan"] = stage_plan(cfg, run, force=force).to_dict()
    warmed = stage_warm(cfg, run)
    out["warm"] = warmed.to_xcom()
    if dry_run:
        return out
    trained = stage_train(cfg, run, warmed)
    evaluated = stage_evaluate(cfg, run, trained, warmed)
    decision = stage_gate(cfg, run, evaluated)
    out.update(train=trained.to_xcom(), evaluate=evaluated.to_xcom(), gate=decision.to_xcom())
    if decision.publish:
        published = stage_publish(cfg, run, trained, evaluated, gate=decision)
        out.update(publish=published.to_xcom(), housekeeping=stage_housekeeping(cfg, run, published).to_xcom())
    return out


def describe_outcome(out: dict[str, Any]) -> list[str]:
    """What a user checks after a run: where it started from, whether it trained, what is live now."""
    run = out["run"]
    replay = "".join(f" + replay {r['url']} (manifest {r['manifest_hash'][:12]}, weight {r['weight']:g})"
                     for r in run.get("replay", []))
    lines = [f"run {run['experiment_key'][:16]}: started from {run['init']['note']}; data {run['data_url']} "
             f"(manifest {run['data_manifest_hash'][:12]}){replay}"]
    if "skipped" in out:
        lines.append(out["skipped"])
        return lines
    if "train" in out:
        t = out["train"]
        if t["outcome"] == "reused":
            lines.append(f"training: reused this run's finished checkpoint {t['checkpoint_tag']} (no training)")
        else:
            resumed = f", resumed at step {t['resumed_from_step']}" if t["outcome"] == "resumed" else ""
            lines.append(f"training: trained {t['trained_steps']} steps{resumed}; loss {t['first_loss']:.4f} -> "
                         f"{t['final_loss']:.4f}")
    if "evaluate" in out:
        lines.append(f"held-out loss {out['evaluate']['loss']:.4f}; gate: {out['gate']['reason']}")
    if "publish" in out:
        pub = out["publish"]
        lines.append(f"{publish_note(PublishResult.from_xcom(pub))}: {pub['artifact_url']}")
        if pruned := out.get("housekeeping", {}).get("pruned"):
            names = ", ".join(sorted({i["url"].rstrip("/").rsplit("/", 1)[-1] for i in pruned}))
            lines.append(f"housekeeping: deleted {names} ({out['housekeeping']['bytes'] / 1e6:.1f} MB); the "
                         f"checkpoint v{pub['version']} came from is kept")
    elif "gate" in out:
        lines.append("not published (refused by the gate)")
    else:
        lines.append(f"dry run: planned and warmed {out['warm']['dataset_dir']}")
    return lines
