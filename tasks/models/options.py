"""Which ModelConfig options each family expresses, torch-free so the config can check them at load.

Why here: the config (tasks.config) refuses an option a family would ignore or could not write into its
config.json before anything is planned or trained; the families' Hugging Face readers refuse the same
options in a config.json. One table, read by both.
"""

from __future__ import annotations

# `model.rope_scaling.rope_type`s each family implements exactly as transformers does (absent: none).
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("llama3",),
    "qwen3": ("llama3",),
    "mistral": ("llama3",),
    "gemma3": ("linear",),  # on the global layers; the sliding ones keep rope_local_base_freq unscaled
}


def rope_types_text(family: str) -> str:
    """What a refusal lists: the supported rope types of `family`."""
    return ", ".join(("default", *ROPE_TYPES.get(family, ())))
