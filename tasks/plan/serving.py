"""Serving memory of the published model: weights plus the KV cache at a concurrency and context."""

from __future__ import annotations

from typing import Any

from tasks.config import JobConfig
from tasks.plan.shapes import total_params

SERVING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1}


def serving_estimate(
    cfg: JobConfig, concurrency: int = 1, context: int | None = None, dtype: str = "bf16"
) -> dict[str, Any]:
    """KV cache per token = layers x kv_heads x head_dim x 2 (K and V) x bytes; total adds the weights.

    context defaults to model.seq_len (the longest the learned positions allow).
    """
    from tasks.errors import InvalidInputError

    m = cfg.model
    context = m.seq_len if context is None else context
    if concurrency <= 0:
        raise InvalidInputError(f"serving concurrency must be positive, got {concurrency}")
    if context <= 0:
        raise InvalidInputError(f"serving context must be positive, got {context}")
    if dtype not in SERVING_BYTES:
        raise InvalidInputError(f"serving dtype must be one of {sorted(SERVING_BYTES)}, got {dtype!r}")
    e = SERVING_BYTES[dtype]
    params = total_params(m)
    weights = params * e
    kv_per_token = m.n_layers * m.kv_heads * m.head_dim * 2 * e
    kv_total = kv_per_token * concurrency * context
    return {
        "dtype": dtype,
        "params": params,
        "weights_bytes": weights,
        "kv_cache_bytes_per_token": kv_per_token,
        "concurrency": concurrency,
        "context": context,
        "kv_cache_bytes": kv_total,
        "serving_bytes": weights + kv_total,
    }
