"""The model families by name and which ModelConfig options each expresses: torch-free and below the
config, so the config can check `model.family` and its options at load without importing a family.

Why here: an option a family would ignore, or could not write into its config.json, must be refused when
the config is loaded (tasks.config), before anything is planned or trained, never trained with silently
different maths; the families' Hugging Face readers refuse the same rope types in a config.json. One
table, read by both. An option is "set" when it differs from its plain value (the ModelConfig default;
head_dim: d_model / n_heads). A new ModelConfig field is an option no family has until listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.config import ModelConfig

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


def refusal(m: ModelConfig) -> str | None:
    """Why `m` cannot be trained as its family: the first option set that the family does not express,
    named with the family's supported ones; None when every option it sets is one the family has."""
    family, supported = m.family, supported_options(m.family)
    for field, info in type(m).model_fields.items():
        if field in NOT_OPTIONS or field == "rope_scaling":  # rope_scaling: by its type, below
            continue
        value = getattr(m, field)
        if field in ALWAYS.get(family, ()):
            if value is not True:
                return f"model.{field} must be true for model.family {family!r} (its attention always has it)"
            continue
        plain = m.d_model // m.n_heads if field == "head_dim" else info.default
        if value != plain and field not in supported:
            return (f"model.{field} ({value!r}) is not supported by model.family {family!r} "
                    f"(its options: {', '.join(supported)})")
    if m.rope_scaling is not None and m.rope_scaling.rope_type not in ROPE_TYPES.get(family, ()):
        return (f"model.rope_scaling.rope_type {m.rope_scaling.rope_type!r} is not supported by model.family "
                f"{family!r} (supported: {rope_types_text(family)})")
    return None


def lora_refusal(m: ModelConfig, target_modules: tuple[str, ...]) -> str | None:
    """Why `train.lora` cannot adapt `m`: target modules the family does not have (listing the ones it has),
    or tied embeddings (DeepSpeed all-reduces a tied weight's gradient between its stages, and a frozen one
    has none); None when it can."""
    known = LORA_TARGETS[m.family]
    unknown = [n for n in target_modules if n not in known]
    if unknown:
        return (f"train.lora.target_modules: unknown to model.family {m.family!r}: "
                f"{', '.join(map(repr, unknown))}; its modules: {', '.join(sorted(known))}")
    if m.tie_embeddings:
        return ("train.lora with model.tie_embeddings is not supported yet (the tied embedding is frozen and "
                "DeepSpeed reduces its gradient); untie it or train in full")
    return None
