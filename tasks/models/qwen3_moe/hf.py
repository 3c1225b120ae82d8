"""Qwen3-MoE Hugging Face mapping: the MoE decoder's tensor names (either expert layout on read) and its
config.json in and out."""

from __future__ import annotations

from typing import Any

import torch

from tasks.config.model import ModelConfig
from tasks.families.qwen3_moe import QWEN3_MOE
from tasks.models.common import hf as common_hf
from tasks.models.common import moe_hf
from tasks.models.common.moe_sharding import DOWN, GATE_UP

# transformers' Qwen3MoeConfig defaults of the keys a config.json may leave out.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    QWEN3_MOE.architectures[0]: ("qwen3_moe", {
        "max_position_embeddings": 32768, "sliding_window": None, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
}
# The per-expert layout (`mlp.experts.E.gate_proj.weight`, ...): each tensor's stacked tensor and its rows' place.
_PER_EXPERT = {"gate_proj.weight": (GATE_UP, 0), "up_proj.weight": (GATE_UP, 1), "down_proj.weight": (DOWN, 0)}
_KNOWN = ("moe_intermediate_size", "norm_topk_prob", "mlp_only_layers")


def hf_tensors(ref: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """As transformers writes them: `blocks.L.mlp.experts.gate_up` -> `model.layers.L.mlp.experts.E.gate_proj.weight`
    and `.up_proj.weight` of each expert E; the rest one tensor each."""
    return moe_hf.per_expert_tensors(ref, tensor, _PER_EXPERT, "mlp.experts") or [(moe_hf.hf_name(ref), tensor)]


def expert_piece(hf_name: str) -> tuple[str, int, int] | None:
    """`model.layers.L.mlp.experts.E.up_proj.weight` -> (`blocks.L.mlp.experts.gate_up`, E, 1)."""
    return moe_hf.per_expert_piece(hf_name, _PER_EXPERT, "mlp.experts")


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: Qwen3MoeForCausalLM (QK-norm, no bias, full attention)."""
    cfg = common_hf.base_hf_config(m, QWEN3_MOE.architectures[0], "qwen3_moe", dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    cfg.update(attention_bias=False, use_sliding_window=False, sliding_window=None, **moe_hf.moe_hf_config(
        m, "num_experts"), moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
        decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=list(m.mlp_only_layers))
    return cfg


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-MoE config.json; a QKV/o bias, `use_sliding_window: true` or a routing
    option these blocks do not implement is refused."""
    _, c, fields = common_hf.read_config(config, QWEN3_MOE.name, ARCHITECTURES)
    common_hf.refuse(c, QWEN3_MOE.name, {"attention_bias": bool(c["attention_bias"]),
                                         "use_sliding_window": bool(c["use_sliding_window"])})
    experts = moe_hf.moe_fields(config, QWEN3_MOE.name, _KNOWN, ARCHITECTURES[QWEN3_MOE.architectures[0]][1])
    width = c["moe_intermediate_size"]
    return {**fields, **experts, "qk_norm": True, "norm_topk_prob": bool(c["norm_topk_prob"]),
            "moe_intermediate_size": None if width == fields["d_ff"] else width,
            "decoder_sparse_step": c["decoder_sparse_step"], "mlp_only_layers": tuple(c["mlp_only_layers"] or ())}
