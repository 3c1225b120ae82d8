"""The model families by name (`model.family`): one torch-free spec module per family, collected here into the
one registry the config (at load) and tasks.models.get_family (the family's model code) both read.

Adding a family = its spec module + one line here + its package under tasks/models/ (the blocks that differ).
"""

from __future__ import annotations

from tasks.base.errors import InvalidInputError
from tasks.families.gemma2 import GEMMA2
from tasks.families.gemma3 import GEMMA3
from tasks.families.gpt import GPT
from tasks.families.llama import LLAMA
from tasks.families.mistral import MISTRAL
from tasks.families.mixtral import MIXTRAL
from tasks.families.qwen3 import QWEN3
from tasks.families.qwen3_moe import QWEN3_MOE
from tasks.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (LLAMA, GPT, QWEN3, MISTRAL, GEMMA3, GEMMA2,
                                                              QWEN3_MOE, MIXTRAL)}


def family_spec(name: str) -> FamilySpec:
    """The spec of `model.family` `name`; an unknown name is refused, listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is unknown; known: {', '.join(sorted(FAMILIES))}") from None


# Mixtures of experts whose blocks differ from the ones built here, refused by name with what is missing.
NOT_BUILT = {
    "DeepseekV3ForCausalLM": "multi-head latent attention, shared experts, grouped biased routing",
    "GptOssForCausalLM": "attention sinks, a clamped SwiGLU, a router bias",
    "Llama4ForCausalLM": "a shared expert, sigmoid routing, chunked attention",
    "Qwen2MoeForCausalLM": "a gated shared expert",
}


def spec_for_architecture(architectures: object) -> FamilySpec:
    """The spec of the family that reads a config.json `architectures` value (a one-element list); others are
    refused (a mixture of experts not built yet naming what it lacks)."""
    if isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in NOT_BUILT:
        raise InvalidInputError(f"config.json architectures {architectures!r} is not supported yet "
                                f"({NOT_BUILT[architectures[0]]}); mixtures of experts supported: "
                                + ", ".join(sorted(a for spec in FAMILIES.values() if spec.routed
                                                   for a in spec.architectures)))
    known = {arch: spec for spec in FAMILIES.values() for arch in spec.architectures}
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in known:
        raise InvalidInputError(f"config.json architectures {architectures!r} is not supported; "
                                f"known: {', '.join(sorted(known))}")
    return known[architectures[0]]
