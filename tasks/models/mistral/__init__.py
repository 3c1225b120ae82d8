"""The Mistral family (`MistralForCausalLM`): Llama's blocks with sliding-window attention.

The layers, shard rules and counts are Llama's (the `sliding_window` option lives in the llama-style
attention, a banded causal mask); this package states only the Hugging Face side.
"""

from __future__ import annotations

from tasks.families.mistral import MISTRAL
from tasks.models.llama import Llama
from tasks.models.mistral import hf


class Mistral(Llama, spec=MISTRAL, parts=(hf,)):
    """Each query attends to the last `sliding_window` positions (null: full causal attention)."""


FAMILY = Mistral()
