"""Gemma's shapes and counts: Llama's plus a norm after attention and after the MLP (replicated over TP)."""

from __future__ import annotations

from tasks.base.layout import ONE_RANK, Layout
from tasks.config.model import ModelConfig
from tasks.models.common import sharding as llama
from tasks.models.shapes import ParamCounts

_POST_NORMS = ("post_attn_norm.weight", "post_mlp_norm.weight")


def full_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every reference parameter and its full shape (Llama's names plus the two post-norms per block)."""
    shapes = llama.full_shapes(m)
    for i in range(m.n_layers):
        shapes.update({f"blocks.{i}.{n}": (m.d_model,) for n in _POST_NORMS})
    return shapes


def param_counts(m: ModelConfig, layout: Layout = ONE_RANK) -> ParamCounts:
    """Parameters one rank of `layout` holds per layer kind (Llama's shard rules; the post-norms replicated)."""
    return llama.param_counts(m, layout, full_shapes(m))
