"""Evaluate stage: every suite's metrics of a committed checkpoint (and of the live model), scored by ranks.

Why ranks: a model at real size exists only as slices across GPUs, so evaluation is a rank
job through the training launcher (tasks/evaluate/worker.py) in `evaluate.parallel` or the
training layout, and nothing on this side loads a weight. Node-local checkpoints (invisible
here) are completed on each node from `train.checkpoint_url` (weight files only). The checkpoint is scored as it
will be served (each weight rounded to `publish.export_dtype`, exactly as the export stores
it). The live model is scored in the same job on the same windows (unless its numbers on
these suites are cached: tasks/evaluate/cache.py), so the gate compares like with like.

Output (`Evaluated`; its JSON form is the stage's XCom): `metrics` {"<suite>.<name>": value} of the
candidate; `live` (version, metrics, cached) or None; `suite_hash`; and, for the first suite, the flat
`loss`, `perplexity`, `tokens` every earlier reader knows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig
from tasks.config.util import sha256_json

if TYPE_CHECKING:
    from tasks.launch import Launch
    from tasks.registry import VersionRecord
    from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveScore:
    """The live version's numbers on this evaluation's suites: scored in its job, or `cached` from before."""

    version: int
    metrics: dict[str, float]
    cached: bool


@dataclass(frozen=True)
class Evaluated:
    """What the evaluate stage hands the gate and publish: the candidate's metrics on every suite, the live
    version's on the same suites, and which checkpoint was scored."""

    metrics: dict[str, float]
    live: LiveScore | None
    suite_hash: str
    suites: tuple[dict[str, Any], ...]
    loss: float
    perplexity: float
    tokens: int
    batches: int
    batch_size: int
    checkpoint_dir: str
    checkpoint_tag: str | None
    step: int | None
    experiment_key: str
    benchmarks: dict[str, Any] = dataclasses.field(default_factory=dict)  # each benchmark's settings and record

    def to_xcom(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "suites": list(self.suites)}
        if not self.benchmarks:  # an evaluation without benchmarks: the XCom it always had
            del out["benchmarks"]
        return out

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Evaluated:
        live = data.get("live")
        return cls(**{**data, "live": None if live is None else LiveScore(**live), "suites": tuple(data["suites"])})


def evaluate(cfg: JobConfig, run: RunIdentity, checkpoint_dir: str | Path, dataset_dir: str | Path, *,
             live: VersionRecord | None = None) -> Evaluated:
    """Score the run's checkpoint (and `live`, unless cached) on every suite, its rank job in the checkpoint's
    run directory; InvalidInputError for incomplete checkpoints, another model's or another run's."""
    from tasks.train.checkpoint import run_dir_of

    launch, pending = evaluation_launch(cfg, run, checkpoint_dir, dataset_dir, run_dir_of(checkpoint_dir), live=live)
    return evaluation_result(cfg, pending, launch.run_here())


def evaluation_launch(cfg: JobConfig, run: RunIdentity, checkpoint_dir: str | Path, dataset_dir: str | Path,
                      run_dir: Path, *, live: VersionRecord | None = None) -> tuple[Launch, dict[str, Any]]:
    """The evaluation ranks' job (in the run directory's `eval/<id>`), and what `evaluation_result` needs of this
    evaluation besides their summary (JSON: it may wait in Airflow while the job runs)."""
    from tasks.evaluate.benchmarks import resolve_benchmarks
    from tasks.evaluate.cache import read_cached
    from tasks.evaluate.spec import resolve_suites, suite_hash
    from tasks.runs.identity import EVAL_DIR
    from tasks.train.checkpoint import validate_checkpoint_dir

    checkpoint_dir = Path(checkpoint_dir)
    candidate: dict[str, Any] = {"name": "candidate", "path": str(checkpoint_dir), "as_dtype": cfg.publish.export_dtype,
                                 "fingerprint": cfg.fingerprint(), "experiment_key": run.experiment_key}
    if checkpoint_dir.is_dir() or not cfg.train.checkpoint_url:  # fail here, before any rank, when we can see it
        validate_checkpoint_dir(checkpoint_dir, cfg.fingerprint(), run.experiment_key)
    else:  # node-local checkpoints: each node completes the weights from the mirror
        from tasks.base.credentials import split_credentials

        public, _ = split_credentials(cfg.train.checkpoint_storage_options, "train.checkpoint_storage_options")
        candidate["mirror"] = {"url": cfg.train.checkpoint_url, "storage_options": public, "run_id": run.run_id}
    suites, benchmarks = resolve_suites(cfg, run), resolve_benchmarks(cfg)
    key = suite_hash(cfg, suites, benchmarks)
    models: list[dict[str, Any]] = [candidate]
    live_metrics = read_cached(cfg, live.version, key) if live is not None else None
    if live is not None and live_metrics is None:
        models.append(version_entry(cfg, run, live, "live"))
    launch = ranks_launch(cfg, run, models, suites, benchmarks, key, Path(dataset_dir), run_dir / EVAL_DIR)
    pending = {"checkpoint_dir": str(checkpoint_dir), "suites": suites, "suite_hash": key, "benchmarks": benchmarks,
               "live_version": None if live is None else live.version, "live_cached": live_metrics}
    return launch, pending


def version_entry(cfg: JobConfig, run: RunIdentity, version: VersionRecord, name: str) -> dict[str, Any]:
    """A published version as one of the models an evaluation job scores: its weights fetched from the store on
    each node (an adapter published alone: on the base it was trained on, this run's or its own)."""
    from tasks.runs.identity import StartingWeights

    weights = StartingWeights(requested="live", version=version.version, digest=version.artifact_digest,
                              url=version.artifact_url, note=f"{name} v{version.version}", kind=version.artifact_kind)
    lora = (version.config or {}).get("train", {}).get("lora")
    if lora is not None and (version.config or {}).get("publish", {}).get("lora_export") == "adapter":
        from tasks.inputs.adapter import base_of

        base = base_of(cfg, version, run.base)
        return {"name": name, "weights": dataclasses.asdict(base), "as_dtype": None,
                "adapter": dataclasses.asdict(weights), "lora": lora}
    return {"name": name, "weights": dataclasses.asdict(weights), "as_dtype": None}


@dataclass(frozen=True)
class VersionsScored:
    """Two published versions on one evaluation's suites (a promotion's candidate and the alias's live one),
    each scored in one rank job or taken from the cache: what the alias's gate compares."""

    candidate: LiveScore
    live: LiveScore | None
    suite_hash: str
    suites: tuple[dict[str, Any], ...]

    def to_xcom(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "suites": list(self.suites)}

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> VersionsScored:
        live = data.get("live")
        return cls(LiveScore(**data["candidate"]), None if live is None else LiveScore(**live), data["suite_hash"],
                   tuple(data["suites"]))


def score_versions(cfg: JobConfig, run: RunIdentity, candidate: VersionRecord, live: VersionRecord | None,
                   dataset_dir: Path, eval_root: Path) -> VersionsScored:
    """Score `candidate` and `live` on the config's suites (the run's data, warmed at `dataset_dir`, for a suite
    without its own source) by evaluation ranks through the job's launcher, each unless its numbers on exactly
    these suites are cached; what is scored is cached. `eval_root` holds the job's directory."""
    from tasks.evaluate.benchmarks import resolve_benchmarks
    from tasks.evaluate.cache import read_cached, write_cached
    from tasks.evaluate.spec import resolve_suites, suite_hash

    suites, benchmarks = resolve_suites(cfg, run), resolve_benchmarks(cfg)
    key = suite_hash(cfg, suites, benchmarks)
    named = {"candidate": candidate, "live": live}
    scores = {name: read_cached(cfg, v.version, key) for name, v in named.items() if v is not None}
    models = [version_entry(cfg, run, named[name], name) for name, cached in scores.items() if cached is None]
    scored = (ranks_launch(cfg, run, models, suites, benchmarks, key, dataset_dir, eval_root).run_here()["models"]
              if models else {})
    out: dict[str, LiveScore] = {}
    for name, cached in scores.items():
        version = named[name]
        assert version is not None
        if cached is None:
            cached = scored[name]
            write_cached(cfg, version.version, key, cached)
        out[name] = LiveScore(version.version, cached, name not in scored)
    return VersionsScored(out["candidate"], out.get("live"), key, tuple(suites))


def evaluation_result(cfg: JobConfig, pending: dict[str, Any], summary: dict[str, Any]) -> Evaluated:
    """The stage's output from the ranks' summary; a live model scored in this job has its numbers cached."""
    from tasks.evaluate.cache import write_cached

    scored, marker = summary["models"], summary["markers"]["candidate"]
    live_version, live_metrics = pending["live_version"], pending["live_cached"]
    if live_version is not None and live_metrics is None:
        live_metrics = scored["live"]
        write_cached(cfg, live_version, pending["suite_hash"], live_metrics)
    metrics = scored["candidate"]
    first = cfg.evaluate.suites[0].name
    return Evaluated(
        metrics=metrics,
        live=None if live_version is None else LiveScore(live_version, live_metrics, "live" not in scored),
        suite_hash=pending["suite_hash"],
        suites=tuple(pending["suites"]),
        loss=metrics[f"{first}.loss"],
        perplexity=metrics[f"{first}.perplexity"],
        tokens=int(metrics[f"{first}.tokens"]),
        batches=cfg.evaluate.batches,
        batch_size=cfg.evaluate.batch_size,
        checkpoint_dir=pending["checkpoint_dir"],
        checkpoint_tag=marker.get("tag"),
        step=marker.get("step"),
        experiment_key=marker["experiment_key"],
        benchmarks={b["name"]: {"settings": b, **summary.get("benchmarks", {}).get("candidate", {}).get(b["name"], {})}
                    for b in pending.get("benchmarks", [])},
    )


def ranks_launch(cfg: JobConfig, run: RunIdentity, models: list[dict[str, Any]], suites: list[dict[str, Any]],
                 benchmarks: list[dict[str, Any]], key: str, dataset_dir: Path, eval_root: Path) -> Launch:
    """The evaluation ranks' job (the job's launcher, the evaluation layout), whose summary has each model's
    metrics and each checkpoint's marker; their status and summary go to `eval_root/<evaluation id>` (the run
    directory's `eval/`), and the engine names the job `eval-<evaluation id>`, not after the run's training."""
    from tasks.base.credentials import split_credentials
    from tasks.launch import JobSpec, Launch, LaunchOptions
    from tasks.plan.evaluation import evaluation_layout

    e = cfg.evaluate
    if e.benchmarks and (run.init.scratch or run.init.kind == "file"):
        raise InvalidInputError(f"evaluate.benchmarks: the harness tokenizes with the starting model's tokenizer, "
                                f"and this run starts from {run.init.note}, which has none")
    eval_id = sha256_json({"run": run.experiment_key, "suites": key, "models": models})
    eval_cfg = evaluation_layout(cfg)
    layout = eval_cfg.parallel.layout
    fields = {"data": "data.storage_options", "store": "publish.storage_options",
              "pretrained": "model.pretrained_storage_options"}
    data_options, data_env = split_credentials(cfg.data.storage_options, fields["data"])
    store_options, store_env = split_credentials(cfg.publish.storage_options, fields["store"])
    model_options, model_env = split_credentials(cfg.model.pretrained_storage_options, fields["pretrained"])
    secret_env = merged_env((fields["data"], data_env), (fields["store"], store_env),
                            (fields["pretrained"], model_env if e.metrics or e.benchmarks else {}))
    spec = {
        "models": models, "suites": suites, "batches": e.batches, "batch_size": e.batch_size, "dtype": e.dtype,
        "metrics": [m.model_dump(mode="json") for m in e.metrics], "benchmarks": benchmarks,
        "cache_dir": cfg.data.cache_dir, "data_storage_options": data_options,
        "store_url": cfg.publish.store_url, "store_options": store_options,
        "model": cfg.model.model_copy(update={"pretrained_storage_options": model_options}).model_dump(mode="json"),
        "starting_weights": dataclasses.asdict(run.init),  # its tokenizer goes to the user metrics
    }
    log.info("evaluate: %s on %d suite(s) with %d ranks (%s)", ", ".join(m["name"] for m in models),
             len(suites), layout.world_size, layout.describe())
    job = JobSpec(f"eval-{eval_id[:12]}", eval_root / eval_id[:16])
    return Launch(eval_cfg, job, dataset_dir, run, LaunchOptions(secret_env=secret_env, evaluation=spec))


def merged_env(*parts: tuple[str, dict[str, str]]) -> dict[str, str]:
    """One environment for the evaluation ranks from each source's credentials; two sources with different
    values for one variable cannot both reach the ranks, so that is refused naming both fields."""
    env: dict[str, str] = {}
    owner: dict[str, str] = {}
    for field, values in parts:
        for name, value in values.items():
            if name in env and env[name] != value:
                raise InvalidInputError(f"{owner[name]} and {field} carry different credentials ({name}); the "
                                        "evaluation ranks read both: give the nodes their own credentials "
                                        "(instance roles) or one key for both")
            env[name], owner[name] = value, field
    return env
