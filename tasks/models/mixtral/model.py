"""Mixtral's layers: the shared mixture-of-experts decoder's, its routing weights scaling the experts' outputs in
fp32 (as transformers' MixtralExperts; Qwen3-MoE casts them to the activations' dtype first)."""

from __future__ import annotations

from tasks.config.model import ModelConfig
from tasks.models.common import blocks, moe
from tasks.models.parallel import TPGroup


class SparseMoE(moe.SparseMoE):
    cast_weights = False


class TransformerBlock(moe.TransformerBlock):
    moe = SparseMoE


class Reference(moe.Reference):
    """The whole Mixtral model in one module (tp=1: full logits)."""

    TransformerBlock = TransformerBlock


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """Llama's pipeline plan with Mixtral's blocks."""
    return blocks.pipeline_layers(m, seed, tp, Reference)
