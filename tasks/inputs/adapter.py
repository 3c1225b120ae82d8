"""Week over week with LoRA: the base a run trains on, and whether it continues the live adapter.

Why its own rule: an adapter is only meaningful on the exact base it was trained on. The base is
`model.base` (a registry version, by number or alias) or `model.pretrained`, identified by digest and
recorded with every version it produces (`base_version`, `base_digest`, migration 0008). `init_from: live`
(or `version:N`) continues that version's adapter only when it was trained on this very base with the same
adapter shape (rank, targets) and published with its adapter; otherwise the run starts a fresh adapter
on the base and says why. Rolling back is moving the alias: the next run continues whatever is live.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import fresh_dir
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig, TrainingJob
from tasks.inputs.weights import WeightSources, pretrained, resolve_starting_weights
from tasks.runs.identity import RunIdentity, StartingWeights, scratch

if TYPE_CHECKING:
    from tasks.models.parallel import TPGroup
    from tasks.registry import Registry, VersionRecord

log = logging.getLogger(__name__)


def resolve_base(cfg: JobConfig, registry: Registry) -> StartingWeights | None:
    """The frozen base of a LoRA run: `model.base`'s registry version, `model.pretrained`, or None (a seeded
    base: demos and tests)."""
    ref = cfg.model.base
    if ref is None:
        return pretrained(cfg, "base") if cfg.model.pretrained is not None else None
    from tasks.registry import NotFoundError

    try:
        record = registry.get_version(ref.model, ref.version) if ref.version is not None else \
            registry.live_version(ref.model, ref.alias or "")
    except NotFoundError as exc:
        raise InvalidInputError(f"model.base: {exc}") from None
    if record is None:
        raise InvalidInputError(f"model.base: {ref.model}/{ref.alias} points at no version yet")
    return StartingWeights(requested="base", version=record.version, digest=record.artifact_digest,
                           url=record.artifact_url, kind=record.artifact_kind,
                           note=f"base {ref.model} v{record.version}" + (f" ({ref.alias})" if ref.alias else ""))


def adapter_start(cfg: JobConfig, registry: Registry, base: StartingWeights | None) -> StartingWeights:
    """What a LoRA run's adapter starts from: the requested version's adapter when it can continue (same base,
    same adapter shape, adapter published), else a fresh adapter on `base` (whose weights the run loads)."""
    requested = cfg.train.init_from
    if requested not in ("scratch", "pretrained", "live") and not requested.startswith("version:"):
        raise InvalidInputError(f"train.init_from {requested!r}: a LoRA run starts from its base (model.base or "
                                "model.pretrained) or continues a version's adapter (live, version:N)")
    if requested == "live" or requested.startswith("version:"):
        start = resolve_starting_weights(cfg, registry)
        if start.version is not None:
            record = registry.get_version(cfg.publish.model_name, start.version)
            why_not = _cannot_continue(cfg, record, base)
            if why_not is None:
                log.info("LoRA: continuing the adapter of %s on %s", start.note, _base_note(base))
                return start
            log.warning("LoRA: starting a fresh adapter on %s: %s", _base_note(base), why_not)
    if base is None:
        return replace(scratch(cfg), requested=requested, note=f"fresh adapter on {_base_note(base)}")
    # The base's own weights, fetched and loaded as any starting weights are; not "trained on" this data.
    return replace(base, requested=requested, trained_on=None, note=f"fresh adapter on {_base_note(base)}")


def base_of(cfg: JobConfig, record: VersionRecord, run_base: StartingWeights | None) -> StartingWeights:
    """The base a LoRA version was trained on (to score it on): this run's base when it is the same weights,
    else the registry version its config names; a pretrained base that changed since is refused."""
    if run_base is not None and run_base.digest == record.base_digest:
        return run_base
    ref = (record.config or {}).get("model", {}).get("base")
    if record.base_version is None or not ref:
        raise InvalidInputError(f"v{record.version} is a LoRA adapter on a base that is not a registry version "
                                f"and not this run's ({(record.base_digest or 'seeded')[:12]}): it cannot be scored")
    base = registry_for(cfg).get_version(ref["model"], record.base_version)
    return StartingWeights(requested="base", version=base.version, digest=base.artifact_digest,
                           url=base.artifact_url, kind=base.artifact_kind, note=f"base {ref['model']} v{base.version}")


def _cannot_continue(cfg: JobConfig, record: VersionRecord, base: StartingWeights | None) -> str | None:
    """Why `record`'s adapter cannot be continued on `base` with this config, or None."""
    lora = cfg.train.lora
    assert lora is not None
    trained = (record.config or {}).get("train", {}).get("lora")
    if record.base_digest is None or trained is None:
        return f"v{record.version} is not a LoRA adapter"
    if base is None or record.base_digest != base.digest:
        now = "a seeded base" if base is None else f"{base.note} ({(base.digest or '')[:12]})"
        return f"the base changed since v{record.version} (trained on {record.base_digest[:12]}, now {now})"
    if (trained["rank"], sorted(trained["target_modules"])) != (lora.rank, sorted(lora.target_modules)):
        return f"v{record.version}'s adapter has another shape (rank {trained['rank']}, {trained['target_modules']})"
    if (record.config or {}).get("publish", {}).get("lora_export") == "merged":
        return f"v{record.version} was published merged, without its adapter"
    return None


def _base_note(base: StartingWeights | None) -> str:
    return "the seeded base" if base is None else base.note


def continues_adapter(init: StartingWeights, base: StartingWeights | None) -> bool:
    """Whether a LoRA run's starting point is a version's adapter (else its init is the base itself)."""
    return base is not None and init.version is not None and init.digest != base.digest


def continues_version(cfg: JobConfig, run: RunIdentity) -> bool:
    """Whether the run carries on from the version it started from: any full training does; a LoRA run only when
    it continues that version's adapter (a fresh adapter on a version's weights starts a new line)."""
    return cfg.train.lora is None or continues_adapter(run.init, run.base)


def parent_version(cfg: JobConfig, run: RunIdentity) -> int | None:
    """The version this run's result descends from, as its published version records it (None: none)."""
    return run.init.version if continues_version(cfg, run) else None


def weights_to_load(cfg: JobConfig | TrainingJob, run: RunIdentity) -> StartingWeights:
    """The weights the ranks load at a fresh start: a LoRA run continuing a version's adapter loads its base
    (the adapter comes beside it, `start_adapter_dir`); any other run its starting weights."""
    if cfg.train.lora is not None and continues_adapter(run.init, run.base):
        assert run.base is not None
        return run.base
    return run.init


def stage_start_adapter(cfg: JobConfig, init: StartingWeights, run_dir: Path) -> Path:
    """Put the continued version's PEFT adapter into the run directory (`start_adapter_dir`, where every rank
    reads it: megabytes)."""
    return fetch_adapter(init, WeightSources.of(cfg), start_adapter_dir(run_dir))


def fetch_adapter(version: StartingWeights, src: WeightSources, dest: Path) -> Path:
    """A LoRA version's PEFT adapter directory at `dest`, fetched from the store once (its tree is the adapter,
    or the merged model with the adapter in `adapter/`: only the adapter's files are fetched)."""
    import shutil
    import tempfile

    from tasks.models.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from tasks.registry import ArtifactStore

    if (dest / ADAPTER_CONFIG).is_file():
        return dest
    assert version.digest is not None
    with tempfile.TemporaryDirectory(prefix="retrainer-adapter-") as tmp:
        log.info("LoRA: fetching the adapter of %s (tree %s)", version.note, version.digest[:12])
        files = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
        tree = ArtifactStore(src.store_url, src.store_options).get_tree(  # the adapter's files only
            version.digest, Path(tmp) / "tree", only=(*files, *(f"adapter/{f}" for f in files)))
        adapter = tree if (tree / ADAPTER_CONFIG).is_file() else tree / "adapter"
        if not (adapter / ADAPTER_CONFIG).is_file():
            raise InvalidInputError(f"{version.note}: its artifact holds no {ADAPTER_CONFIG}")
        try:
            with fresh_dir(dest) as staged:
                for file in adapter.iterdir():
                    shutil.copyfile(file, staged / file.name)
        except InvalidInputError:  # another node's warm put it into a shared run directory first
            if not (dest / ADAPTER_CONFIG).is_file():
                raise
    return dest


def start_adapter_dir(run_dir: str | Path) -> Path:
    """Where a LoRA run that continues a version finds that version's adapter."""
    return Path(run_dir) / "start-adapter"


def load_start_adapter(module: Any, cfg: TrainingJob, run: RunIdentity, tp: TPGroup) -> int:
    """A fresh run that continues a version's adapter: load this rank's adapter slices from the staged PEFT
    directory (after `apply_lora`); returns the count (0: a fresh adapter)."""
    if not continues_adapter(run.init, run.base):
        return 0
    from tasks.models.lora_export import PeftAdapter, load_adapter

    count = load_adapter(module, PeftAdapter(start_adapter_dir(cfg.train.output_dir), cfg.model), cfg.model, tp)
    log.info("LoRA: continuing the adapter of %s (%d tensors on this rank)", run.init.note, count)
    return count
