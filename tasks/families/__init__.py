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
from tasks.families.qwen3 import QWEN3
from tasks.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (LLAMA, GPT, QWEN3, MISTRAL, GEMMA3, GEMMA2)}


def family_spec(name: str) -> FamilySpec:
    """The spec of `model.family` `name`; an unknown name is refused, listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is unknown; known: {', '.join(sorted(FAMILIES))}") from None


def spec_for_architecture(architectures: object) -> FamilySpec:
    """The spec of the family that reads a config.json `architectures` value (a one-element list); others are
    refused."""
    known = {arch: spec for spec in FAMILIES.values() for arch in spec.architectures}
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in known:
        raise InvalidInputError(f"config.json architectures {architectures!r} is not supported; "
                                f"known: {', '.join(sorted(known))}")
    return known[architectures[0]]
