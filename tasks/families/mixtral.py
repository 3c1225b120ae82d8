"""Mixtral (`MixtralForCausalLM`): Llama's attention (sliding window optional) with routed experts in every layer,
each expert `d_ff` wide, its top-k weights always renormalised."""

from __future__ import annotations

from tasks.families.llama import ATTENTION, MLP, ROTARY
from tasks.families.spec import FamilySpec

# Every mixture-of-experts family's options.
MOE = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef")
EXPERTS = (*MLP, "w1", "w2", "w3")  # the routed experts' linears (Mixtral's per-expert names too): not adaptable yet

MIXTRAL = FamilySpec(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    options=(*ROTARY, "sliding_window", *MOE),
    lora_targets=ATTENTION,
    expert_targets=EXPERTS,
    always=("norm_topk_prob",),
    rope_types=("llama3",),
)
