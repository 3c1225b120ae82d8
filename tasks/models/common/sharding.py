"""The rotary dense decoder's (Llama's, tasks/models/common/blocks.py) shapes, tensor-parallel shard rules and
exact counts (the one place they are stated)."""

from __future__ import annotations

import math

import torch

from tasks.base.layout import ONE_RANK, ORIGIN, Coord, Layout
from tasks.config.model import ModelConfig
from tasks.models.common.names import BLOCK
from tasks.models.family import EMBED, HEAD
from tasks.models.parallel import shard_range
from tasks.models.shapes import ParamCounts


def _block_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, q, kv, ff = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
    bias = m.qkv_bias
    return {
        "attn_norm.weight": (d,),
        "attn.q.weight": (q, d),
        **({"attn.q.bias": (q,)} if bias else {}),
        "attn.k.weight": (kv, d),
        **({"attn.k.bias": (kv,)} if bias else {}),
        "attn.v.weight": (kv, d),
        **({"attn.v.bias": (kv,)} if bias else {}),
        "attn.o.weight": (d, q),
        # QK-norm weights are per head_dim, shared by every head: replicated across TP (no split rule).
        **({"attn.q_norm.weight": (m.head_dim,), "attn.k_norm.weight": (m.head_dim,)} if m.qk_norm else {}),
        "mlp_norm.weight": (d,),
        "mlp.gate.weight": (ff, d),
        "mlp.up.weight": (ff, d),
        "mlp.down.weight": (d, ff),
    }


def full_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every reference parameter and its full (unsharded) shape; tied models have no head.out.weight."""
    shapes: dict[str, tuple[int, ...]] = {f"{EMBED}.tok.weight": (m.vocab_size, m.d_model)}
    for i in range(m.n_layers):
        shapes.update({f"blocks.{i}.{n}": s for n, s in _block_shapes(m).items()})
    shapes[f"{HEAD}.norm.weight"] = (m.d_model,)
    if not m.tie_embeddings:
        shapes[f"{HEAD}.out.weight"] = (m.vocab_size, m.d_model)
    return shapes


def _split_dim(m: ModelConfig, name: str) -> tuple[int, int, str] | None:
    """(dim, full size, config field) along which `name` is TP-sharded; None = replicated."""
    if name in (f"{EMBED}.tok.weight", f"{HEAD}.out.weight"):
        return 0, m.vocab_size, "model.vocab_size"
    match = BLOCK.fullmatch(name)
    rel = match.group(2) if match else name
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "attn.q.weight": (0, q, "model.n_heads"),
        "attn.q.bias": (0, q, "model.n_heads"),
        "attn.k.weight": (0, kv, "model.n_kv_heads"),
        "attn.k.bias": (0, kv, "model.n_kv_heads"),
        "attn.v.weight": (0, kv, "model.n_kv_heads"),
        "attn.v.bias": (0, kv, "model.n_kv_heads"),
        "attn.o.weight": (1, q, "model.n_heads"),
        "mlp.gate.weight": (0, m.ffn, "model.d_ff"),
        "mlp.up.weight": (0, m.ffn, "model.d_ff"),
        "mlp.down.weight": (1, m.ffn, "model.d_ff"),
    }.get(rel)


def shard_spec(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of the full tensor `name` (a reference name) held by the rank at `coord`; None = replicated.

    Every split is one contiguous range: heads (q/k/v rows, o columns), the MLP's
    hidden units (gate/up rows, down columns) and the vocab rows (embedding, head).
    """
    split = _split_dim(m, name)
    if split is None:
        return None
    dim, size, field = split
    start, end = shard_range(size, layout, coord, field)
    return dim, torch.arange(start, end)


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble a full tensor from its TP pieces (ordered by TP rank)."""
    split = _split_dim(m, name)
    if split is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=split[0])


def _held(m: ModelConfig, name: str, shape: tuple[int, ...], layout: Layout) -> int:
    """Elements of `name` one rank of `layout` holds."""
    split = _split_dim(m, name)
    if split is None:
        return math.prod(shape)
    shard_range(split[1], layout, ORIGIN, split[2])  # refuses an uneven split, naming the field
    return math.prod(shape) // layout.tp


def param_counts(m: ModelConfig, layout: Layout = ONE_RANK,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> ParamCounts:
    """Parameters one rank of `layout` holds per layer kind, as DeepSpeed places them.

    embedding: vocab/tp rows x d. block: norms replicated, q/k/v/o and gate/up/down
    sharded. head: final norm + the vocab/tp x d LM head. With tied embeddings the
    head's matrix is DeepSpeed's tied copy of the embedding (TiedLayerSpec): it is
    counted on stage 0 *and* on the last stage, since with pp > 1 both stages hold
    it (and its optimizer states). With pp == 1 the two are one tensor: a stage
    holding both layers holds `embedding` fewer parameters than the sum. `shapes`: a family's own full
    shapes on Llama's shard rules (Gemma's extra norms, replicated); None = Llama's.
    """
    held = {EMBED: 0, "blocks": 0, HEAD: 0}
    for name, shape in (shapes or full_shapes(m)).items():
        kind = name.split(".", 1)[0]
        if kind != "blocks" or name.startswith("blocks.0."):
            held[kind] += _held(m, name, shape, layout)
    embedding = held[EMBED]
    return ParamCounts(
        embedding=embedding,
        block=held["blocks"],
        head=held[HEAD] + (embedding if m.tie_embeddings else 0),
    )
