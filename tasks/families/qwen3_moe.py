"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (QK-norm) with routed experts of their own width, dense
layers where `mlp_only_layers` / `decoder_sparse_step` say."""

from __future__ import annotations

from tasks.families.llama import ATTENTION, ROTARY
from tasks.families.mixtral import EXPERTS, MOE
from tasks.families.spec import FamilySpec

QWEN3_MOE = FamilySpec(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    options=(*ROTARY, "qk_norm", *MOE, "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"),
    lora_targets=ATTENTION,
    expert_targets=EXPERTS,
    always=("qk_norm",),
    rope_types=("llama3", "yarn"),
)
