"""Publish stage: export a finished checkpoint, upload it, record an immutable version, move the alias.

The artifact is a Hugging Face model directory, committed as a content-addressed tree. The
training ranks already wrote its weight shards into the store's staging area
(tasks/train/export.py); publish adds the small files (index, config.json, tokenizer) and commits
it, so no weight passes through this machine. Only when that staging area is gone (say, a run reused
long after its export was discarded) does publish export here, from the checkpoint's layer files
(tasks/models/export.py, one process per stage), and upload. The order is the protocol:
1) content-addressed commit, 2) insert the version
(idempotent on the artifact digest), 3) switch the alias with a compare-and-swap
on the version that was live when publish started. A crash between 2 and 3 leaves
an unpointed version (harmless; a re-run picks it up), never a dangling pointer.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.base.audit import default_actor
from tasks.base.credentials import redact
from tasks.base.errors import InvalidInputError, LiveMovedError
from tasks.base.policy import NotPermittedError
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.registry import ArtifactRef, ArtifactStore, Lineage, alias_asset_uri
from tasks.registry.lineage_checks import check_metrics

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PublishResult:
    model: str
    alias: str
    version: int
    previous_version: int | None
    artifact_url: str
    digest: str
    created: bool
    switched: bool
    asset_uri: str
    parent_version: int | None
    started_from: str  # the version's record: scratch, pretrained <dir>, version <N>, weights <path>

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> PublishResult:
        return cls(**data)


def code_revision() -> str:
    """RETRAINER_CODE_REVISION, else the git HEAD of this checkout, else 'unknown'."""
    if rev := os.environ.get("RETRAINER_CODE_REVISION"):
        return rev
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
            text=True, timeout=10, check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def require_approval(cfg: JobConfig, approved_by: str | None) -> None:
    """Refuse a move onto an alias whose policy requires a person's approval when nobody approved it."""
    alias = cfg.publish.alias
    if cfg.publish.approval_required and not approved_by:
        raise NotPermittedError(
            f"publish.policy.{alias}.approval is required: a person in its approvers approves every move onto "
            f"{alias!r}, under Airflow (the approval step of retrain_{cfg.name} or promote_model); none was given "
            "here: nothing moved")


def publish(
    cfg: JobConfig,
    checkpoint_dir: Path,
    metrics: dict[str, Any],
    *,
    experiment_key: str | None = None,
    serving_bytes: int | None = None,
    actor: str | None = None,
    reason: str = "publish",
    registry_url: str | None = None,
    staged: dict[str, Any] | None = None,
    judged_live: int | type[Ellipsis] | None = ...,
    approved_by: str | None = None,
) -> PublishResult:
    """Publish `checkpoint_dir`, exported as a Hugging Face directory, as the next version and point
    `cfg.publish.alias` at it. The tokenizer and context length of the model the run started from (its
    lineage, in the checkpoint's marker) go with the export. `staged`: the training summary's `export`
    (the shards the ranks wrote).

    The version's lineage (experiment key, data, starting weights and the version they were) comes from
    the checkpoint's own COMPLETE marker: what the weights were trained from is a fact of the checkpoint.
    The version also records `cfg` as resolved, credentials redacted (what made it, beside the hashes).
    With `experiment_key`, a checkpoint of another run is refused. `judged_live`: the live version the gate
    compared the candidate with (None: none was live); if the alias points elsewhere now, LiveMovedError
    before anything is uploaded (unless it points at this very checkpoint's version: a retried publish).
    `approved_by`: the person who approved this publish (the retrain DAG's approval step checked them against
    the alias's approvers); an alias whose policy requires approval is refused without one, before anything
    is uploaded, whichever path calls (the DAG, `retrainer run`, `retrainer publish`)."""
    from tasks.inputs.adapter import continues_version, parent_version
    from tasks.inputs.weights import WeightSources, fetch_model_files
    from tasks.runs.identity import RunIdentity
    from tasks.train.checkpoint import validate_checkpoint_dir

    checkpoint_dir = Path(checkpoint_dir)
    actor = actor or default_actor()
    if not checkpoint_dir.is_dir():
        raise InvalidInputError(f"{checkpoint_dir}: checkpoint directory does not exist")
    marker = validate_checkpoint_dir(checkpoint_dir, cfg.fingerprint(), experiment_key)
    run = RunIdentity.from_dict(marker["run"])
    metrics = check_metrics(metrics)

    pub = cfg.publish
    require_approval(cfg, approved_by)
    reg = registry_for(cfg, registry_url)  # its first query checks the schema: nothing is uploaded to a stale one
    live = reg.live_version(pub.model_name, pub.alias)
    previous = live.version if live else None
    if judged_live is not ... and previous != judged_live:
        mine = reg.find_version(pub.model_name, run.experiment_key, checkpoint_dir.name)
        if mine is None or mine.version != previous:
            now, then = (f"v{v}" if v is not None else "no version" for v in (previous, judged_live))
            raise LiveMovedError(f"{pub.model_name}/{pub.alias} is {now} now; the gate compared this "
                                 f"candidate with {then}: not published (run again to judge it against "
                                 "what is live)")
    with tempfile.TemporaryDirectory(prefix="retrainer-base-") as tmp:  # the parent's config and tokenizer
        files_of = run.base if cfg.train.lora is not None and run.base is not None else run.init
        base_dir = fetch_model_files(files_of, WeightSources.of(cfg), Path(tmp) / "base")
        ref = artifact(cfg, ArtifactStore(pub.store_url, pub.storage_options), checkpoint_dir, base_dir, staged,
                       base_model=(run.base.url or "") if run.base is not None else "")
    # A LoRA version's parent is the version whose adapter it continued (a fresh adapter has none); its
    # base is recorded beside it (tasks/inputs/adapter.py).
    lora = cfg.train.lora is not None
    continued, parent = continues_version(cfg, run), parent_version(cfg, run)
    lineage = Lineage(
        config_hash=run.experiment_key, data_manifest_hash=run.data_manifest_hash, code_revision=code_revision(),
        checkpoint_tag=checkpoint_dir.name, serving_bytes=serving_bytes, parent_version=parent,
        init_digest=run.init.digest, data_url=run.data_url, data_replay=[asdict(r) for r in run.replay],
        config=redact(cfg.model_dump(mode="json")),
        started_from=redact(run.init.origin if continued else run.init.note),  # "fresh adapter on base ..."
        base_version=run.base.version if lora and run.base is not None else None,
        base_digest=run.base.digest if lora and run.base is not None else None,
    )
    record = reg.publish_version(pub.model_name, ref, lineage, metrics, created_by=actor)
    switched = False
    if previous != record.version:
        reg.switch_alias(pub.model_name, pub.alias, record.version, expect=previous, actor=actor,
                         reason=reason, action="publish")
        switched = True
    return PublishResult(
        model=pub.model_name, alias=pub.alias, version=record.version, previous_version=previous,
        artifact_url=ref.url, digest=ref.digest, created=record.created, switched=switched,
        asset_uri=alias_asset_uri(pub.model_name, pub.alias), parent_version=parent,
        started_from=record.started_from or redact(run.init.origin),
    )


def artifact(cfg: JobConfig, store: ArtifactStore, checkpoint_dir: Path, base_dir: Path | None,
             staged: dict[str, Any] | None, base_model: str = "") -> ArtifactRef:
    """The version's tree: the ranks' staged shards committed with the small files, else exported here (a
    LoRA run's: its adapter and/or merged model, tasks/models/lora_export.py)."""
    if cfg.train.lora is not None:
        from tasks.models.lora_export import export_lora

        dest = export_dir(checkpoint_dir, f"{cfg.publish.export_dtype}-lora-{cfg.publish.lora_export}")
        return store.put_tree(export_lora(
            cfg.model, cfg.train.lora, cfg.publish.lora_export, checkpoint_dir, dest, stages=cfg.parallel.pp,
            dtype=cfg.publish.export_dtype, base_dir=base_dir if base_dir is not None and base_dir.is_dir() else None,
            base_model=base_model))
    wanted = (checkpoint_dir.name, cfg.publish.export_dtype)
    if staged and staged.get("shards") and (staged.get("tag"), staged.get("dtype")) == wanted:
        try:
            return commit_staged(cfg, store, staged["shards"], base_dir)
        except InvalidInputError as exc:
            log.warning("publish: the ranks' export cannot be committed (%s); exporting here instead", exc)
    return store.put_tree(export(cfg, checkpoint_dir, base_dir))


def commit_staged(cfg: JobConfig, store: ArtifactStore, shards: list[dict[str, Any]],
                  base_dir: Path | None) -> ArtifactRef:
    """Add index, config.json, generation_config.json and tokenizer files to the staged shards; commit."""
    from tasks.models.export import write_metadata
    from tasks.registry.tree import TreeFile, TreeManifest

    staging = shards[0]["staging"]
    weight_map = {name: s["file"]["path"] for s in shards for name in s["weights"]}
    total = sum(sum(s["weights"].values()) for s in shards)
    with tempfile.TemporaryDirectory(prefix="retrainer-publish-") as tmp:
        names = write_metadata(Path(tmp), cfg.model, weight_map, total, dtype=cfg.publish.export_dtype,
                               base_dir=base_dir if base_dir is not None and base_dir.is_dir() else None)
        files = [TreeFile.from_dict(s["file"]) for s in shards]
        files += [store.stage_file(staging, name, Path(tmp) / name) for name in names]
    return store.commit_tree(staging, TreeManifest.of(files))


def export(cfg: JobConfig, checkpoint_dir: Path, base_dir: Path | None) -> Path:
    """The checkpoint's Hugging Face export beside the run's checkpoints (`<run>/export/<tag>`), written
    once: the directory appears whole (renamed into place) or not at all, so a retry reuses it."""
    from tasks.base.model_files import HF_INDEX
    from tasks.models.export import export_checkpoint

    dest = export_dir(checkpoint_dir, cfg.publish.export_dtype)
    if (dest / HF_INDEX).is_file():
        log.info("export: reusing %s", dest)
        return dest
    return export_checkpoint(cfg.model, checkpoint_dir, dest, stages=cfg.parallel.pp,
                             dtype=cfg.publish.export_dtype,
                             base_dir=base_dir if base_dir is not None and base_dir.is_dir() else None)


def export_dir(checkpoint_dir: Path, dtype: str) -> Path:
    """Where publish exports a checkpoint itself: `<run>/export/<tag>-<dtype>/` (a full copy of the weights,
    which housekeeping deletes once the version is published)."""
    from tasks.runs.identity import EXPORT_DIR
    from tasks.train.checkpoint import run_dir_of

    return run_dir_of(checkpoint_dir) / EXPORT_DIR / f"{checkpoint_dir.name}-{dtype}"
