"""Llama (Llama 2/3, Qwen2 with `qkv_bias`): the rotary dense decoder the other rotary families build on."""

from __future__ import annotations

from tasks.families.spec import FamilySpec

ROTARY = ("rope_theta", "rms_norm_eps", "tie_embeddings", "head_dim")  # every rotary family's options
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention's linears (PEFT names)
MLP = ("gate_proj", "up_proj", "down_proj")  # the SwiGLU MLP's
PROJ = (*ATTENTION, *MLP)  # its block linears

LLAMA = FamilySpec(
    name="llama",
    architectures=("LlamaForCausalLM", "Qwen2ForCausalLM"),
    options=(*ROTARY, "qkv_bias"),
    lora_targets=PROJ,
    rope_types=("llama3", "yarn"),  # yarn: Qwen2.5 long context (Qwen2ForCausalLM)
)
