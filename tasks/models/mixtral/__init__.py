"""The Mixtral family (`MixtralForCausalLM`): Llama's attention (sliding window optional) with routed experts in
every layer, each `d_ff` wide.

The shard rules and counts are the shared mixture-of-experts decoder's (tasks/models/common/moe_sharding.py);
model.py: its routing weights kept in fp32 (the rest of the layers and the loss: common/moe.py); hf.py: its
per-expert names and config.json in and out.
"""

from __future__ import annotations

from tasks.families.mixtral import MIXTRAL
from tasks.models.common import moe, moe_hf, moe_sharding
from tasks.models.llama import Llama
from tasks.models.mixtral import hf, model


class Mixtral(Llama, spec=MIXTRAL, parts=(model, moe_sharding, hf, moe_hf, moe)):
    """Top-k of `num_experts` experts per token in every layer, the routing weights always renormalised."""


FAMILY = Mixtral()
