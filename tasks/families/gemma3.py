"""Gemma 3 (text): Gemma's blocks with QK-norm always on and a rotary base of its own on the sliding layers."""

from __future__ import annotations

from tasks.families.llama import PROJ, ROTARY
from tasks.families.spec import FamilySpec

GEMMA = (*ROTARY, "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar", "attn_logit_softcapping",
         "final_logit_softcapping")  # every Gemma's options

GEMMA3 = FamilySpec(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    options=(*GEMMA, "qk_norm", "rope_local_base_freq"),
    lora_targets=PROJ,
    always=("qk_norm",),
    rope_types=("linear",),  # on the global layers; the sliding ones keep rope_local_base_freq unscaled
)
