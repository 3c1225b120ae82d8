"""Qwen3: Llama's blocks with QK-norm always on."""

from __future__ import annotations

from tasks.families.llama import PROJ, ROTARY
from tasks.families.spec import FamilySpec

QWEN3 = FamilySpec(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    options=(*ROTARY, "qk_norm"),
    lora_targets=PROJ,
    always=("qk_norm",),
    rope_types=("llama3", "yarn"),
)
