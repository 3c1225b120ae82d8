"""The Qwen3 family (`Qwen3ForCausalLM`): Llama's blocks with QK-norm, no QKV bias, its own head_dim.

The layers, shard rules and counts are Llama's (the `qk_norm` and `head_dim` options live in the
llama-style blocks, where the maths is shared); this package states only the Hugging Face side.
"""

from __future__ import annotations

from typing import ClassVar

from tasks.models.llama import Llama
from tasks.models.qwen3 import hf


class Qwen3(Llama):
    """Per-head RMSNorm on queries and keys before rotary (`self_attn.q_norm`/`k_norm`, [head_dim], replicated)."""

    name = "qwen3"
    architectures: ClassVar[tuple[str, ...]] = tuple(hf.ARCHITECTURES)
    hf_name = staticmethod(hf.hf_name)
    ref_name = staticmethod(hf.ref_name)
    hf_config = staticmethod(hf.hf_config)
    model_fields_from_hf = staticmethod(hf.model_fields_from_hf)


FAMILY = Qwen3()
