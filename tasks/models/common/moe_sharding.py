"""The mixture-of-experts decoder's shapes, shard rules and exact counts: Llama's, with a router [E, H]
(replicated) and stacked experts, gate_up [E, 2I, H] and down [E, H, I], in each MoE layer; every expert split
over TP along its hidden units as the dense MLP is, and the experts themselves over `ep` ranks (`expert_range`:
a cut of dim 0 before the TP rule)."""

from __future__ import annotations

import math

import torch

from tasks.base.layout import ONE_RANK, ORIGIN, Coord, Layout
from tasks.config.model import ModelConfig
from tasks.models.common import sharding as llama
from tasks.models.common.names import BLOCK
from tasks.models.parallel import shard_range
from tasks.models.shapes import ParamCounts

DENSE_MLP = ("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
ROUTER, GATE_UP, DOWN = "mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down"
_FIELD = "model.moe_intermediate_size (the experts' width; null: model.d_ff)"


def full_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every reference parameter and its full shape: Llama's, each MoE layer's dense MLP replaced by its router
    and stacked experts."""
    assert m.num_experts is not None
    shapes = llama.full_shapes(m)
    e, i, h = m.num_experts, m.expert_ffn, m.d_model
    for layer in range(m.n_layers):
        if m.routed(layer):
            for name in DENSE_MLP:
                del shapes[f"blocks.{layer}.{name}"]
            shapes.update({f"blocks.{layer}.{ROUTER}": (e, h), f"blocks.{layer}.{GATE_UP}": (e, 2 * i, h),
                           f"blocks.{layer}.{DOWN}": (e, h, i)})
    return dict(sorted(shapes.items(), key=lambda item: _order(item[0])))


def _order(name: str) -> tuple[int, int]:
    """Embedding, blocks by index, head: the reference model's order (its state dict's)."""
    match = BLOCK.fullmatch(name)
    return (1, int(match.group(1))) if match else (0 if name.startswith("embed.") else 2, 0)


def shard_spec(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of the full tensor `name` the rank at `coord` holds: an expert's share of its hidden units
    (gate_up: those gate rows and the same up rows; down: those columns), Llama's rule for the rest."""
    match = BLOCK.fullmatch(name)
    rel = match.group(2) if match else name
    if rel not in (GATE_UP, DOWN):
        return llama.shard_spec(m, name, layout, coord)
    width = m.expert_ffn
    start, end = shard_range(width, layout, coord, _FIELD)
    if rel == DOWN:
        return 2, torch.arange(start, end)
    return 1, torch.cat([torch.arange(start, end), torch.arange(width + start, width + end)])


def is_expert_tensor(name: str) -> bool:
    """Whether `name` (a reference name, or a layer's own: `mlp.experts.down`) is a stacked expert tensor."""
    return name.endswith((GATE_UP, DOWN))


def expert_range(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, int] | None:
    """[first, end) of the experts of tensor `name` the rank at `coord` holds under expert parallelism; None
    where it holds them all (ep 1) or `name` is no stacked expert tensor (any family's)."""
    if layout.ep == 1 or not is_expert_tensor(name):
        return None
    assert m.num_experts is not None
    per = m.num_experts // layout.ep
    return coord.ep * per, (coord.ep + 1) * per


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from its TP pieces (by TP rank): gate_up's gate rows of every rank, then their up rows."""
    rel = BLOCK.fullmatch(name).group(2) if BLOCK.fullmatch(name) else name
    if len(pieces) == 1 or rel not in (GATE_UP, DOWN):
        return llama.unshard(m, name, pieces)
    if rel == DOWN:
        return torch.cat(pieces, dim=2)
    halves = [p.chunk(2, dim=1) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)


def param_counts(m: ModelConfig, layout: Layout = ONE_RANK) -> ParamCounts:
    """Parameters one rank of `layout` holds per layer kind; blocks differ where some layers are dense."""
    shapes = full_shapes(m)
    per_block, experts = [0] * m.n_layers, [0] * m.n_layers
    outside = {"embed": 0, "head": 0}
    for name, shape in shapes.items():
        match = BLOCK.fullmatch(name)
        held = _held(m, name, shape, layout)
        if match:
            per_block[int(match.group(1))] += held
            experts[int(match.group(1))] += held if is_expert_tensor(name) else 0
        else:
            outside[name.split(".", 1)[0]] += held
    embedding = outside["embed"]
    return ParamCounts(embedding=embedding, block=max(per_block), head=outside["head"] + (
        embedding if m.tie_embeddings else 0), per_block=tuple(per_block), experts_per_block=tuple(experts))


def _held(m: ModelConfig, name: str, shape: tuple[int, ...], layout: Layout) -> int:
    """Elements of `name` one rank of `layout` holds (an uneven split refused, naming the field)."""
    spec = shard_spec(m, name, layout, ORIGIN)
    held = math.prod(shape) if spec is None else math.prod(shape) // shape[spec[0]] * len(spec[1])
    experts = expert_range(m, name, layout, ORIGIN)
    return held if experts is None else held // shape[0] * (experts[1] - experts[0])


def unrouted_params(m: ModelConfig) -> int:
    """The parameters of the experts a token is not routed to: (E - k) experts of every MoE layer."""
    assert m.num_experts is not None and m.num_experts_per_tok is not None
    per_expert = 3 * m.expert_ffn * m.d_model
    return sum(m.routed(i) for i in range(m.n_layers)) * (m.num_experts - m.num_experts_per_tok) * per_expert
