"""The Gemma 3 family (`Gemma3ForCausalLM`, text): Llama's projections and shard rules with Gemma's blocks.

Gemma 2 (tasks/models/gemma2) is this family without QK-norm, with soft-capping and one rotary base.

model.py: the layers (x * (1 + w) norms, four per block, scaled embedding, GELU-tanh, per-layer
sliding/global attention with two rotary bases); sharding.py: shapes and counts; hf.py: names and config.json.
"""

from __future__ import annotations

from typing import Any

from tasks.config.model import ModelConfig
from tasks.families.gemma3 import GEMMA3
from tasks.models.gemma3 import hf, model, sharding
from tasks.models.llama import Llama


class Gemma3(Llama, spec=GEMMA3, parts=(model, sharding, hf)):
    """Tied by default; every `sliding_window_pattern`-th layer attends globally, the others slide.

    The config.json side is Gemma's for both Gemmas, told which one it writes or reads (`name`)."""

    def hf_config(self, m: ModelConfig, *, dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        return hf.hf_config(self.name, m, dtype=dtype, **extra)

    def model_fields_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        return hf.model_fields_from_hf(self.name, config)

    def hf_rope_parameters(self, m: ModelConfig) -> dict[str, Any] | None:
        return hf.hf_rope_parameters(self.name, m)

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
