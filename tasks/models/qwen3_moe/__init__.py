"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`): Qwen3's attention (QK-norm) with routed experts.

The layers, shard rules and counts are the shared mixture-of-experts decoder's (tasks/models/common/moe.py,
moe_sharding.py, moe_hf.py); hf.py: its per-expert names and config.json in and out.
"""

from __future__ import annotations

from tasks.families.qwen3_moe import QWEN3_MOE
from tasks.models.common import moe, moe_hf, moe_sharding
from tasks.models.llama import Llama
from tasks.models.qwen3_moe import hf


class Qwen3Moe(Llama, spec=QWEN3_MOE, parts=(moe, moe_sharding, hf, moe_hf)):
    """Top-k of `num_experts` experts per token in the layers `decoder_sparse_step` / `mlp_only_layers` route,
    the routing weights renormalised when `norm_topk_prob`; the other layers a dense MLP of `d_ff`."""


FAMILY = Qwen3Moe()
