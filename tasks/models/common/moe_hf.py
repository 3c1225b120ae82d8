"""The mixture-of-experts decoder's Hugging Face mapping: transformers 5's names of the router and the stacked
experts (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), the per-expert layout
transformers' `save_pretrained` writes and the Hub's checkpoints hold (each expert's gate, up and down as its own
tensor: stacked on read, written by an export so that transformers and vLLM load it), and the config.json keys
every MoE family reads and writes."""

from __future__ import annotations

import re
from typing import Any

import torch

from tasks.base.errors import InvalidInputError
from tasks.config.model import ModelConfig
from tasks.models.common import hf as common_hf
from tasks.models.common.moe_sharding import DOWN, GATE_UP, ROUTER
from tasks.models.common.names import BLOCK

_MOE_NAMES = {ROUTER: "mlp.gate.weight", GATE_UP: "mlp.experts.gate_up_proj", DOWN: "mlp.experts.down_proj"}
_HF_MOE = {v: k for k, v in _MOE_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# A config.json key naming a routing option (router, routed, experts, moe, top-k): refused unless the family
# reads it (its `known` keys) or it holds the value of the routing these blocks implement (ROUTER_NEUTRAL).
_ROUTING_KEY = re.compile(r"rout|expert|moe|topk|top_k")
ROUTER_NEUTRAL: dict[str, object] = {"router_jitter_noise": 0.0}
KNOWN = ("num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")


def hf_name(ref_name: str) -> str:
    """`blocks.3.mlp.experts.gate_up` -> `model.layers.3.mlp.experts.gate_up_proj` (transformers 5's stacked
    experts); attention, norms and dense MLPs as the shared decoder names them."""
    match = BLOCK.fullmatch(ref_name)
    if match and match.group(2) in _MOE_NAMES:
        return f"model.layers.{match.group(1)}.{_MOE_NAMES[match.group(2)]}"
    return common_hf.hf_name(ref_name)


def ref_name(hf_name: str, aliases: dict[str, str] | None = None) -> str:
    """The inverse of `hf_name`; `aliases`: a family's older names of the MoE tensors (Mixtral's
    `block_sparse_moe.`), each to transformers 5's."""
    match = _HF_LAYER.fullmatch(hf_name)
    if match:
        rest = match.group(2)
        for old, new in (aliases or {}).items():
            rest = rest.replace(old, new) if rest.startswith(old) else rest
        if rest in _HF_MOE:
            return f"blocks.{match.group(1)}.{_HF_MOE[rest]}"
        hf_name = f"model.layers.{match.group(1)}.{rest}"
    return common_hf.ref_name(hf_name)


def per_expert_piece(hf_name: str, parts: dict[str, tuple[str, int]], prefix: str) -> tuple[str, int, int] | None:
    """(stacked reference name, expert, part) of a per-expert tensor `model.layers.L.<prefix>.E.<part name>`;
    `parts`: each per-expert tensor's (stacked tensor, its place in the expert's rows: gate 0, up 1)."""
    match = re.fullmatch(rf"model\.layers\.(\d+)\.{re.escape(prefix)}\.(\d+)\.(.+)", hf_name)
    if match is None or match.group(3) not in parts:
        return None
    stacked, part = parts[match.group(3)]
    return f"blocks.{match.group(1)}.{stacked}", int(match.group(2)), part


def per_expert_tensors(ref: str, tensor: torch.Tensor, parts: dict[str, tuple[str, int]],
                       prefix: str) -> list[tuple[str, torch.Tensor]] | None:
    """A stacked expert tensor as the per-expert layout holds it (the inverse of `per_expert_piece`):
    `model.layers.L.<prefix>.E.<part name>` views of expert E's rows; None: `ref` is not a stacked tensor."""
    match = BLOCK.fullmatch(ref)
    own = sorted((part, name) for name, (stacked, part) in parts.items() if match and stacked == match.group(2))
    if not own:
        return None
    rows = tensor.shape[1] // len(own)
    return [(f"model.layers.{match.group(1)}.{prefix}.{expert}.{name}", tensor[expert, part * rows:(part + 1) * rows])
            for expert in range(tensor.shape[0]) for part, name in own]


def moe_hf_config(m: ModelConfig, experts_key: str) -> dict[str, Any]:
    """The routing keys every MoE family writes, the expert count under `experts_key` (Qwen: `num_experts`,
    Mixtral: `num_local_experts`); transformers trains with the auxiliary loss only with `output_router_logits`
    (its `router_aux_loss_coef` is read only then)."""
    aux = m.router_aux_loss_coef > 0
    return {experts_key: m.num_experts, "num_experts_per_tok": m.num_experts_per_tok, "output_router_logits": aux,
            **({"router_aux_loss_coef": m.router_aux_loss_coef} if aux else {})}


def moe_fields(config: dict[str, Any], family: str, known: tuple[str, ...],
               defaults: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig routing fields of a config.json; a routing option these blocks do not implement (shared
    experts, grouped or biased routing, jitter, any key it does not know: `known`, the family's own) is refused,
    naming its key. The auxiliary loss trains as transformers trains it: `router_aux_loss_coef` (its default
    0.001) when `output_router_logits`, else none. `defaults`: transformers' values of the keys config.json
    leaves out."""
    for key, value in config.items():
        if not _ROUTING_KEY.search(key) or key in (*KNOWN, *known):
            continue
        if key not in ROUTER_NEUTRAL or value != ROUTER_NEUTRAL[key]:
            raise InvalidInputError(f"config.json {key} = {value!r}: a routing option model.family {family!r} "
                                    "does not implement")
    c = {**defaults, **config}
    experts = config.get("num_experts", config.get("num_local_experts", c.get("num_experts", c.get(
        "num_local_experts"))))
    if not isinstance(experts, int) or experts < 1:
        raise InvalidInputError(f"config.json num_experts = {experts!r}: a mixture of experts needs at least one")
    per_token = c.get("num_experts_per_tok")
    if not isinstance(per_token, int) or not 1 <= per_token <= experts:
        raise InvalidInputError(f"config.json num_experts_per_tok = {per_token!r}: 1 to num_experts ({experts})")
    aux = float(c.get("router_aux_loss_coef", 0.001)) if c.get("output_router_logits") else 0.0
    return {"num_experts": experts, "num_experts_per_tok": per_token, "router_aux_loss_coef": aux}
