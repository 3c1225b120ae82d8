"""The Gemma 3 family (`Gemma3ForCausalLM`, text): Llama's projections and shard rules with Gemma's blocks.

Gemma 2 (tasks/models/gemma2) is this family without QK-norm, with soft-capping and one rotary base.

model.py: the layers (x * (1 + w) norms, four per block, scaled embedding, GELU-tanh, per-layer
sliding/global attention with two rotary bases); sharding.py: shapes and counts; hf.py: names and config.json.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from tasks.config import ModelConfig
from tasks.models.gemma import hf, model, sharding
from tasks.models.llama import Llama


class Gemma3(Llama):
    """Tied by default; every `sliding_window_pattern`-th layer attends globally, the others slide."""

    name = "gemma3"
    architectures: ClassVar[tuple[str, ...]] = tuple(hf.ARCHITECTURES["gemma3"])
    Embedding, TransformerBlock, Head, Reference = model.Embedding, model.TransformerBlock, model.Head, model.Reference

    pipeline_layers = staticmethod(model.pipeline_layers)
    full_shapes = staticmethod(sharding.full_shapes)
    param_counts = staticmethod(sharding.param_counts)
    hf_name = staticmethod(hf.hf_name)
    ref_name = staticmethod(hf.ref_name)
    hf_config = staticmethod(functools.partial(hf.hf_config, "gemma3"))
    model_fields_from_hf = staticmethod(functools.partial(hf.model_fields_from_hf, "gemma3"))
    hf_rope_parameters = staticmethod(functools.partial(hf.rope_parameters, "gemma3"))

    def _sliding_layers(self, m: ModelConfig) -> int:
        return sum(model.is_sliding(m, i) for i in range(m.n_layers))

    def flops_per_token(self, m: ModelConfig) -> float:
        """6N plus the attention term per layer: sliding layers score min(seq_len, W) keys, global ones seq_len."""
        c = self.param_counts(m)
        local = self._sliding_layers(m)
        span = local * min(m.seq_len, m.sliding_window or m.seq_len) + (m.n_layers - local) * m.seq_len
        return 6.0 * (m.n_layers * c.block + c.head) + 12.0 * span * m.n_heads * m.head_dim

    def kv_cache_bytes(self, m: ModelConfig, element_bytes: int, context: int) -> int:
        """KV bytes of one sequence: sliding layers hold the last min(context, W) positions, global ones all."""
        local = self._sliding_layers(m)
        held = local * min(context, m.sliding_window or context) + (m.n_layers - local) * context
        return held * m.kv_heads * m.head_dim * 2 * element_bytes


FAMILY = Gemma3()
