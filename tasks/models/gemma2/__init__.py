"""The Gemma 2 family (`Gemma2ForCausalLM`): Gemma 3's blocks without QK-norm, with one rotary base and
attention-score and final-logit soft-capping (explicit attention: SDPA's fused path cannot cap scores)."""

from __future__ import annotations

import functools
from typing import ClassVar

from tasks.models.gemma import Gemma3, hf


class Gemma2(Gemma3):
    """Every other layer global (`sliding_window_pattern` 2); scores and logits soft-capped."""

    name = "gemma2"
    architectures: ClassVar[tuple[str, ...]] = tuple(hf.ARCHITECTURES["gemma2"])
    hf_config = staticmethod(functools.partial(hf.hf_config, "gemma2"))
    model_fields_from_hf = staticmethod(functools.partial(hf.model_fields_from_hf, "gemma2"))
    hf_rope_parameters = staticmethod(functools.partial(hf.rope_parameters, "gemma2"))


FAMILY = Gemma2()
