"""A run's identity as it starts: the data at `data.source_url` as it is now and the starting weights resolved
(`retrainer train` on warmed datasets resolves its starting weights here too: one rule for every run).

Why its own module: a LoRA run's identity also names its frozen base and whether it continues the live
adapter (tasks/inputs/adapter.py), which resolves on top of the plain starting weights (tasks/inputs/weights.py).
"""

from __future__ import annotations

from tasks.config.schema import JobConfig
from tasks.data.warm import remote_manifest_hash
from tasks.inputs.adapter import adapter_start, resolve_base
from tasks.inputs.weights import resolve_starting_weights
from tasks.registry import Registry
from tasks.runs.identity import RunIdentity, StartingWeights, identity


def resolve_identity(cfg: JobConfig, registry: Registry) -> RunIdentity:
    """The identity of a run starting now: the data at `data.source_url` as it is, and what it starts from
    (`resolve_start`)."""
    data_hash = remote_manifest_hash(cfg.data.source_url, cfg.data.manifest, cfg.data.storage_options)
    replay = [remote_manifest_hash(r.source_url, r.manifest, r.storage_options) for r in cfg.data.replay]
    init, base = resolve_start(cfg, registry)
    return identity(cfg, data_hash, init, replay, base)


def resolve_start(cfg: JobConfig, registry: Registry) -> tuple[StartingWeights, StartingWeights | None]:
    """What a run starting now starts from: `train.init_from` resolved, and for a LoRA run its base (the run
    continues a version's adapter on it, or starts a fresh one); None: no base (not a LoRA run)."""
    if cfg.train.lora is not None:
        base = resolve_base(cfg, registry)
        return adapter_start(cfg, registry, base), base
    return resolve_starting_weights(cfg, registry), None
