"""The GPT family: a GPT-2-style decoder (pre-LN, learned positions, fused QKV, GELU MLP, untied head).

model.py: the layers; sharding.py: shapes, shard rules and counts; hf.py: export names and config.json.
"""

from __future__ import annotations

from tasks.families.gpt import GPT as SPEC
from tasks.models.family import ModelFamily
from tasks.models.gpt import hf, model, sharding


class GPT(ModelFamily, spec=SPEC, parts=(model, sharding, hf)):
    """Replicated embedding and head; exported under retrainer's own architecture name (no transformers class)."""

    vocab_parallel = False


FAMILY = GPT()
