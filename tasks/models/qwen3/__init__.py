"""The Qwen3 family (`Qwen3ForCausalLM`): Llama's blocks with QK-norm, no QKV bias, its own head_dim.

The layers, shard rules and counts are Llama's (the `qk_norm` and `head_dim` options live in the
llama-style blocks, where the maths is shared); this package states only the Hugging Face side.
"""

from __future__ import annotations

from tasks.families.qwen3 import QWEN3
from tasks.models.llama import Llama
from tasks.models.qwen3 import hf


class Qwen3(Llama, spec=QWEN3, parts=(hf,)):
    """Per-head RMSNorm on queries and keys before rotary (`self_attn.q_norm`/`k_norm`, [head_dim], replicated)."""


FAMILY = Qwen3()
