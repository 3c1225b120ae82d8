"""The Gemma 2 family (`Gemma2ForCausalLM`): Gemma 3's blocks without QK-norm, with one rotary base and
attention-score and final-logit soft-capping (explicit attention: SDPA's fused path cannot cap scores)."""

from __future__ import annotations

from tasks.families.gemma2 import GEMMA2
from tasks.models.gemma3 import Gemma3


class Gemma2(Gemma3, spec=GEMMA2):
    """Every other layer global (`sliding_window_pattern` 2); scores and logits soft-capped."""


FAMILY = Gemma2()
