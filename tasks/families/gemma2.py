"""Gemma 2: Gemma's blocks without QK-norm, one rotary base, no rope scaling."""

from __future__ import annotations

from tasks.families.gemma3 import GEMMA
from tasks.families.llama import PROJ
from tasks.families.spec import FamilySpec

GEMMA2 = FamilySpec(name="gemma2", architectures=("Gemma2ForCausalLM",), options=GEMMA, lora_targets=PROJ)
