"""Mistral: Llama's blocks with sliding-window attention."""

from __future__ import annotations

from tasks.families.llama import PROJ, ROTARY
from tasks.families.spec import FamilySpec

MISTRAL = FamilySpec(
    name="mistral",
    architectures=("MistralForCausalLM",),
    options=(*ROTARY, "sliding_window"),
    lora_targets=PROJ,
    rope_types=("llama3",),
)
