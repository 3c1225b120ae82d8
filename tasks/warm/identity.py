"""A run's identity as it starts: the data at `data.source_url` as it is now and the starting weights resolved.

Why its own module: a LoRA run's identity also names its frozen base and whether it continues the live
adapter (tasks/warm/adapter.py), which resolves on top of the plain starting weights (tasks/warm/weights.py).
"""

from __future__ import annotations

from tasks.config import JobConfig
from tasks.registry import Registry
from tasks.run import RunIdentity, identity
from tasks.warm.adapter import adapter_start, resolve_base
from tasks.warm.core import remote_manifest_hash
from tasks.warm.weights import resolve_starting_weights


def resolve_identity(cfg: JobConfig, registry: Registry) -> RunIdentity:
    """The identity of a run starting now: the data at `data.source_url` as it is, `train.init_from` resolved
    (for a LoRA run: its base, and the adapter it continues or a fresh one)."""
    data_hash = remote_manifest_hash(cfg.data.source_url, cfg.data.manifest, cfg.data.storage_options)
    replay = [remote_manifest_hash(r.source_url, r.manifest, r.storage_options) for r in cfg.data.replay]
    if cfg.train.lora is not None:
        base = resolve_base(cfg, registry)
        return identity(cfg, data_hash, adapter_start(cfg, registry, base), replay, base)
    return identity(cfg, data_hash, resolve_starting_weights(cfg, registry), replay)
