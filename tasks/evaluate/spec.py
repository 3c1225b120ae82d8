"""What an evaluation computes, decided on the launcher's side and handed to the ranks by value.

The windows of a suite are a deterministic function of the config (`evaluate.batches` x
`evaluate.batch_size` windows evenly spaced over the suite's split), so any layout scores the same
tokens. The suite hash names everything that decides an evaluation's numbers except the weights
(each suite's data by manifest hash, the windows, the model shape, the compute dtype, the user
metrics, the benchmarks): a live version's numbers are cached under it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.config.schema import JobConfig
from tasks.config.util import sha256_json
from tasks.data.warm import remote_manifest_hash

if TYPE_CHECKING:
    from tasks.runs.identity import RunIdentity


def window_order(n_windows: int, batches: int, batch_size: int) -> np.ndarray:
    """Indices of the evaluated windows: evenly spaced, wrapping when the split holds fewer than requested."""
    total = batches * batch_size
    return (np.arange(total) * max(1, n_windows // total)) % n_windows


def resolve_suites(cfg: JobConfig, run: RunIdentity) -> list[dict[str, Any]]:
    """Every suite with the source it is read from and the manifest hash it must verify as (the run's own
    data for a suite without `source_url`; the others as they are now)."""
    out = []
    for suite in cfg.evaluate.suites:
        if suite.source_url is None:
            source, manifest, digest = run.data_url, cfg.data.manifest, run.data_manifest_hash
        else:
            source, manifest = suite.source_url, suite.manifest
            digest = remote_manifest_hash(source, manifest, cfg.data.storage_options)
        out.append({"name": suite.name, "source_url": source, "manifest": manifest, "split": suite.split,
                    "manifest_hash": digest})
    return out


def suite_hash(cfg: JobConfig, suites: list[dict[str, Any]], benchmarks: list[dict[str, Any]] | None = None) -> str:
    """sha256 of what decides an evaluation's numbers besides the weights (see the module docstring); the
    benchmarks as resolved (tasks/evaluate/benchmarks.py: settings, harness version, task folder digest), here
    unless the caller resolved them already."""
    from tasks.evaluate.benchmarks import resolve_benchmarks

    e = cfg.evaluate
    if benchmarks is None:
        benchmarks = resolve_benchmarks(cfg)
    return sha256_json({
        **({"benchmarks": benchmarks} if benchmarks else {}),  # without: the hash every earlier cache entry has
        "suites": [{k: s[k] for k in ("name", "split", "manifest_hash")} for s in suites],
        "batches": e.batches, "batch_size": e.batch_size, "dtype": e.dtype,
        "model": cfg.model.model_dump(mode="json", exclude={"pretrained", "pretrained_storage_options", "dropout"}),
        "metrics": [m.model_dump(mode="json") for m in e.metrics],
    })
