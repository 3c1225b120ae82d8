"""GPT-family shapes, tensor-parallel shard rules and exact counts (the one place they are stated)."""

from __future__ import annotations

import math

import torch

from tasks.base.layout import ONE_RANK, ORIGIN, Coord, Layout
from tasks.config.model import ModelConfig
from tasks.models.common.names import relative
from tasks.models.family import EMBED, HEAD
from tasks.models.shapes import ParamCounts


def qkv_rows(m: ModelConfig, layout: Layout, coord: Coord) -> torch.Tensor:
    """Row indices of the full fused QKV weight that the rank at `coord` owns (its q, k and v heads)."""
    hd, nq, nkv, tp_rank = m.head_dim, m.n_heads, m.kv_heads, coord.tp
    q_per, kv_per = nq // layout.tp, nkv // layout.tp
    q = torch.arange(tp_rank * q_per * hd, (tp_rank + 1) * q_per * hd)
    k = nq * hd + torch.arange(tp_rank * kv_per * hd, (tp_rank + 1) * kv_per * hd)
    v = (nq + nkv) * hd + torch.arange(tp_rank * kv_per * hd, (tp_rank + 1) * kv_per * hd)
    return torch.cat([q, k, v])


def shard_spec(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of the full tensor `name` (a reference name) held by the rank at `coord`; None = replicated."""
    name = relative(name)
    if name in ("attn.qkv.weight", "attn.qkv.bias"):
        return 0, qkv_rows(m, layout, coord)
    per_heads = m.n_heads * m.head_dim // layout.tp
    per_ff = m.ffn // layout.tp
    tp_rank = coord.tp
    if name == "attn.out.weight":
        return 1, torch.arange(tp_rank * per_heads, (tp_rank + 1) * per_heads)
    if name in ("mlp.fc1.weight", "mlp.fc1.bias"):
        return 0, torch.arange(tp_rank * per_ff, (tp_rank + 1) * per_ff)
    if name == "mlp.fc2.weight":
        return 1, torch.arange(tp_rank * per_ff, (tp_rank + 1) * per_ff)
    return None


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble a full tensor from its TP pieces (ordered by TP rank)."""
    tp_size = len(pieces)
    rel = relative(name)
    spec = shard_spec(m, rel, Layout(tp=tp_size), ORIGIN)
    if spec is None or tp_size == 1:
        return pieces[0]
    dim = spec[0]
    if rel.startswith("attn.qkv"):
        hd = m.head_dim
        q_len, kv_len = m.n_heads // tp_size * hd, m.kv_heads // tp_size * hd
        parts = [p.split([q_len, kv_len, kv_len], dim=0) for p in pieces]
        return torch.cat([torch.cat([pp[i] for pp in parts], dim=0) for i in range(3)], dim=0)
    return torch.cat(pieces, dim=dim)


def full_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Reference name -> full (unsharded) shape of every parameter, computed without building the model."""
    d, hd = m.d_model, m.head_dim
    qkv, attn = (m.n_heads + 2 * m.kv_heads) * hd, m.n_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        f"{EMBED}.tok.weight": (m.vocab_size, d), f"{EMBED}.pos.weight": (m.seq_len, d),
    }
    block = {
        "ln1.weight": (d,), "ln1.bias": (d,), "attn.qkv.weight": (qkv, d), "attn.qkv.bias": (qkv,),
        "attn.out.weight": (d, attn), "attn.out.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
        "mlp.fc1.weight": (m.ffn, d), "mlp.fc1.bias": (m.ffn,), "mlp.fc2.weight": (d, m.ffn), "mlp.fc2.bias": (d,),
    }
    for i in range(m.n_layers):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({f"{HEAD}.ln.weight": (d,), f"{HEAD}.ln.bias": (d,), f"{HEAD}.out.weight": (m.vocab_size, d)})
    return shapes


def param_counts(m: ModelConfig, layout: Layout = ONE_RANK) -> ParamCounts:
    """Per-rank parameter counts: column/row-parallel weights sharded across TP; LayerNorms, row-parallel biases,
    the embeddings (token + learned positions) and the LM head replicated on every TP rank."""
    shapes = full_shapes(m)
    held = {EMBED: 0, "blocks": 0, HEAD: 0}
    for name, shape in shapes.items():
        kind = name.split(".", 1)[0]
        if kind == "blocks" and not name.startswith("blocks.0."):
            continue
        held[kind] += math.prod(shape) // (layout.tp if shard_spec(m, name, ONE_RANK, ORIGIN) is not None else 1)
    return ParamCounts(embedding=held[EMBED], block=held["blocks"], head=held[HEAD])
