"""The model families by name and which ModelConfig options each expresses: torch-free and below the
config, so the config can check `model.family` and its options at load without importing a family.

Why here: an option a family would ignore, or could not write into its config.json, must be refused when
the config is loaded (tasks.config), before anything is planned or trained, never trained with silently
different maths; the families' Hugging Face readers refuse the same rope types in a config.json. These
are the tables; the checks are the config's (`family_refusal`, `lora_refusal`). An option is "set" when
it differs from its plain value (the ModelConfig default; head_dim: d_model / n_heads). A new ModelConfig
field is an option no family has until listed here.
"""

from __future__ import annotations

# name -> package whose `FAMILY` is the family object (tasks.models.get_family imports it on demand).
# Adding a family = its package + one line here (and in OPTIONS below).
FAMILIES: dict[str, str] = {
    "llama": "tasks.models.llama",
    "gpt": "tasks.models.gpt",
    "qwen3": "tasks.models.qwen3",
    "mistral": "tasks.models.mistral",
    "gemma3": "tasks.models.gemma",
    "gemma2": "tasks.models.gemma2",
}
# ModelConfig fields every family has (sizes, where the model comes from): not options.
NOT_OPTIONS = frozenset({"vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "family",
                         "pretrained", "pretrained_storage_options", "base"})
_ROTARY = ("rope_theta", "rms_norm_eps", "tie_embeddings", "head_dim")
_GEMMA = (*_ROTARY, "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar", "attn_logit_softcapping",
          "final_logit_softcapping")
# family -> the options it expresses (rope_scaling: see ROPE_TYPES).
OPTIONS: dict[str, tuple[str, ...]] = {
    "gpt": ("dropout",),
    "llama": (*_ROTARY, "qkv_bias"),
    "qwen3": (*_ROTARY, "qk_norm"),
    "mistral": (*_ROTARY, "sliding_window"),
    "gemma3": (*_GEMMA, "qk_norm", "rope_local_base_freq"),
    "gemma2": _GEMMA,
}
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# family -> the module names `train.lora.target_modules` may name: PEFT's (the last part of each block linear's
# Hugging Face name). tests/lora/test_config.py holds each against the linears the built family has.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt": ("qkv", "out", "fc1", "fc2"),
    "llama": _PROJ,
    "qwen3": _PROJ,
    "mistral": _PROJ,
    "gemma3": _PROJ,
    "gemma2": _PROJ,
}
# family -> the boolean options its maths always has (they must be true).
ALWAYS: dict[str, tuple[str, ...]] = {"qwen3": ("qk_norm",), "gemma3": ("qk_norm",)}
# `model.rope_scaling.rope_type`s each family implements exactly as transformers does (absent: none).
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("llama3", "yarn"),  # yarn: Qwen2.5 long context (Qwen2ForCausalLM)
    "qwen3": ("llama3", "yarn"),
    "mistral": ("llama3",),
    "gemma3": ("linear",),  # on the global layers; the sliding ones keep rope_local_base_freq unscaled
}


def rope_types_text(family: str) -> str:
    """What a refusal lists: the supported rope types of `family`."""
    return ", ".join(("default", *ROPE_TYPES.get(family, ())))


def supported_options(family: str) -> tuple[str, ...]:
    """Every option `family` expresses (rope_scaling where it implements a rope type)."""
    return (*OPTIONS[family], *(("rope_scaling",) if family in ROPE_TYPES else ()))
