"""Model families by name (`model.family`): each is a module with the same API.

A family module provides its pipeline layers, tensor-parallel shard rules, exact
parameter counts and FLOPs, and (where it has one) its Hugging Face name mapping.
Families are imported lazily, so asking for one never imports torch for the others.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {
    "gpt": "tasks.models.gpt",
    "llama": "tasks.models.llama",
}


def get_family(name: str) -> ModuleType:
    """The module implementing model family `name`."""
    try:
        module = FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is unknown; known: {', '.join(sorted(FAMILIES))}") from None
    return importlib.import_module(module)
