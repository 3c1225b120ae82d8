"""GPT: a GPT-2-style decoder (learned positions, no rotary), exported under retrainer's own architecture name."""

from __future__ import annotations

from tasks.families.spec import FamilySpec

GPT = FamilySpec(name="gpt", architectures=("RetrainerGPT",), options=("dropout",),
                 lora_targets=("qkv", "out", "fc1", "fc2"), rotary=False, transformers_model=False)
