"""Mixtral Hugging Face mapping: the MoE decoder's tensor names (transformers 5's, or the original
`block_sparse_moe.` with per-expert `w1`/`w3`/`w2` on read) and its config.json in and out."""

from __future__ import annotations

from typing import Any

import torch

from tasks.config.model import ModelConfig
from tasks.families.mixtral import MIXTRAL
from tasks.models.common import hf as common_hf
from tasks.models.common import moe_hf
from tasks.models.common.moe_sharding import DOWN, GATE_UP, ROUTER
from tasks.models.common.names import BLOCK

# transformers' MixtralConfig defaults of the keys a config.json may leave out (null window: full attention).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    MIXTRAL.architectures[0]: ("mixtral", {"max_position_embeddings": 131072, "rope_theta": 1e6,
                                           "rms_norm_eps": 1e-5, "sliding_window": None, "num_local_experts": 8,
                                           "num_experts_per_tok": 2}),
}
_OLD = {"block_sparse_moe.": "mlp."}  # the original checkpoints' name of the MoE module
# The per-expert layout (`block_sparse_moe.experts.E.w1.weight`: gate, w3: up, w2: down).
_PER_EXPERT = {"w1.weight": (GATE_UP, 0), "w3.weight": (GATE_UP, 1), "w2.weight": (DOWN, 0)}


def ref_name(hf_name: str) -> str:
    """The inverse of the MoE decoder's `hf_name`, reading the original `block_sparse_moe.` names too."""
    return moe_hf.ref_name(hf_name, _OLD)


def hf_tensors(ref: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """As transformers writes them (the original names): the router as `block_sparse_moe.gate.weight`, each
    expert E's parts as `block_sparse_moe.experts.E.w1/w3/w2.weight`; the rest one tensor each."""
    match = BLOCK.fullmatch(ref)
    if match and match.group(2) == ROUTER:
        return [(f"model.layers.{match.group(1)}.block_sparse_moe.gate.weight", tensor)]
    return moe_hf.per_expert_tensors(ref, tensor, _PER_EXPERT, "block_sparse_moe.experts") or [
        (moe_hf.hf_name(ref), tensor)]


def expert_piece(hf_name: str) -> tuple[str, int, int] | None:
    """`model.layers.L.block_sparse_moe.experts.E.w3.weight` -> (`blocks.L.mlp.experts.gate_up`, E, 1)."""
    return moe_hf.per_expert_piece(hf_name, _PER_EXPERT, "block_sparse_moe.experts")


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: MixtralForCausalLM, its `sliding_window` written back (null = full)."""
    cfg = common_hf.base_hf_config(m, MIXTRAL.architectures[0], "mixtral", dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    cfg.update(sliding_window=m.sliding_window, router_jitter_noise=0.0,
               **moe_hf.moe_hf_config(m, "num_local_experts"))
    return cfg


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral config.json; a routing option these blocks do not implement is refused."""
    _, c, fields = common_hf.read_config(config, MIXTRAL.name, ARCHITECTURES)
    experts = moe_hf.moe_fields(config, MIXTRAL.name, (), ARCHITECTURES[MIXTRAL.architectures[0]][1])
    return {**fields, **experts, "sliding_window": c["sliding_window"], "norm_topk_prob": True}
