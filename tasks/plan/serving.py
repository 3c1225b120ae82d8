"""Serving memory of the published model: weights plus the KV cache at the config's `serving` section."""

from __future__ import annotations

from typing import Any

from tasks.config.schema import JobConfig
from tasks.models import get_family

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1}  # bytes per element: `serving.dtype`, `evaluate.dtype`


def serving_estimate(cfg: JobConfig) -> dict[str, Any]:
    """KV cache per token as the model family states it (K and V per layer and kv head); total adds the weights.

    Sliding-window layers hold at most the window's positions per sequence (`kv_cache_bytes`).

    `serving.context_len` defaults to model.seq_len (the longest the learned positions allow).
    """
    m, s = cfg.model, cfg.serving
    context = m.seq_len if s.context_len is None else s.context_len
    e = DTYPE_BYTES[s.dtype]
    family = get_family(m.family)
    params = family.total_params(m)
    weights = params * e
    kv_per_token = family.kv_bytes_per_token(m, e)
    kv_total = family.kv_cache_bytes(m, e, context) * s.concurrency
    return {
        "dtype": s.dtype,
        "params": params,
        "weights_bytes": weights,
        "kv_cache_bytes_per_token": kv_per_token,
        "concurrency": s.concurrency,
        "context": context,
        "kv_cache_bytes": kv_total,
        "serving_bytes": weights + kv_total,
    }
