"""The Mistral family (`MistralForCausalLM`): Llama's blocks with sliding-window attention.

The layers, shard rules and counts are Llama's (the `sliding_window` option lives in the llama-style
attention, a banded causal mask); this package states only the Hugging Face side.
"""

from __future__ import annotations

from typing import ClassVar

from tasks.models.llama import Llama
from tasks.models.mistral import hf


class Mistral(Llama):
    """Each query attends to the last `sliding_window` positions (null: full causal attention)."""

    name = "mistral"
    architectures: ClassVar[tuple[str, ...]] = tuple(hf.ARCHITECTURES)
    hf_config = staticmethod(hf.hf_config)
    model_fields_from_hf = staticmethod(hf.model_fields_from_hf)


FAMILY = Mistral()
