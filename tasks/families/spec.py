"""What a model family states without torch: the ModelConfig options it expresses, the config.json architectures
it reads, its rope types and LoRA targets.

Why torch-free and below the config: an option a family would ignore, or could not write into its config.json,
must be refused when the config is loaded (tasks.config), before anything is planned or trained, never trained
with silently different maths; the families' Hugging Face readers refuse the same rope types in a config.json.
An option is "set" when it differs from its plain value (the ModelConfig default; head_dim: d_model / n_heads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySpec:
    """One family's torch-free facts; its model code is the package `tasks.models.<name>` (its `FAMILY`)."""

    name: str  # `model.family`
    architectures: tuple[str, ...]  # config.json `architectures` it reads
    options: tuple[str, ...]  # the ModelConfig options it expresses (rope_scaling: see rope_types)
    # The module names `train.lora.target_modules` may name: PEFT's (the last part of each block linear's Hugging
    # Face name). tests/lora/test_config.py holds them against the linears the built family has.
    lora_targets: tuple[str, ...]
    # Names of the routed experts' linears: refused as LoRA targets with that reason (not built yet; vLLM ignores
    # the expert adapters it does not support), rather than as unknown.
    expert_targets: tuple[str, ...] = ()
    always: tuple[str, ...] = ()  # the boolean options its maths always has (they must be true)
    # `model.rope_scaling.rope_type`s it implements exactly as transformers does.
    rope_types: tuple[str, ...] = ()
    rotary: bool = True  # positions by rotary embeddings (head_dim must be even)
    transformers_model: bool = True  # its exports load in transformers (and vLLM): deployable

    @property
    def routed(self) -> bool:
        """A mixture of experts: its MoE layers route each token to `num_experts_per_tok` of `num_experts`."""
        return "num_experts" in self.options

    @property
    def package(self) -> str:
        """The package whose `FAMILY` is the family object (tasks.models.get_family imports it on demand)."""
        return f"tasks.models.{self.name}"

    def rope_types_text(self) -> str:
        """What a refusal lists: the supported rope types."""
        return ", ".join(("default", *self.rope_types))

    def supported_options(self) -> tuple[str, ...]:
        """Every option the family expresses (rope_scaling where it implements a rope type)."""
        return (*self.options, *(("rope_scaling",) if self.rope_types else ()))
