"""The rotary dense decoder's layers: Llama's (Llama 2/3, Qwen2 with `qkv_bias`), and what Qwen3, Mistral and
Gemma build on (QK-norm, sliding window and head_dim are options here; Gemma subclasses where it differs).

Why it looks like this: every parameter maps 1:1 to one Hugging Face tensor (q, k,
v, gate, up and down are separate linears) and rotary uses transformers'
`rotate_half` convention, so HF weights load with no permutation. The same layer
classes build the 3D pipeline and the single-process `Reference`; each layer
draws its full-size initial weights from its own seeded generator (seed, layer
index), one tensor at a time, and a tensor-parallel rank keeps only its slice,
so any (tp, pp, dp) layout starts from the same weights.

Architecture: pre-RMSNorm blocks; grouped-query attention with q/k/v
column-parallel (sharded by heads) and o row-parallel, causal SDPA; SwiGLU MLP
with gate/up column-parallel and down row-parallel; no biases except the
optional q/k/v bias; vocabulary-parallel embedding, LM head and cross entropy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config.model import ModelConfig
from tasks.models.common import reference as common
from tasks.models.common.init import layer_generator
from tasks.models.common.packing import Packing, document_mask, pack, unpack
from tasks.models.common.rotary import inv_freq, rope_attention_scale, rotate_half
from tasks.models.common.sharding import full_shapes, shard_spec
from tasks.models.family import EMBED, HEAD
from tasks.models.parallel import (
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    copy_to_tp,
    row_parallel,
    set_slice,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
    vocab_parallel_token_nll,
)

INIT_STD = 0.02
TIED = "tok.weight"  # the embedding attribute DeepSpeed ties between the first and last stage


def init_layer(layer: nn.Module, m: ModelConfig, seed_layer: int, seed: int | None, tp: TPGroup, *,
               shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = full_shapes,
               shards: Callable[..., tuple[int, torch.Tensor] | None] = shard_spec, norm_init: float = 1.0,
               experts: Callable[..., tuple[int, int] | None] | None = None) -> None:
    """Fill the layer's parameters in order from its own generator, one full tensor at a time, keeping our slice.

    Linear weights and the embedding ~ N(0, 0.02); norms `norm_init` (Gemma's x * (1 + w): 0); q/k/v
    biases 0. `seed` None: no draw (the weights are loaded next: a resume or starting weights), only the
    tensor-parallel marks. `shapes`, `shards`: the family's full shapes and shard rule; `experts`: a mixture of
    experts' `expert_range` (the experts this rank holds, cut before the TP rule).
    """
    g = None if seed is None else layer_generator(seed, seed_layer)
    full_shapes_of = shapes(m)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            ref = f"{layer.ref_prefix}.{name}"
            shape = full_shapes_of[ref]
            if g is None:
                full = None
            elif name.endswith("norm.weight"):
                full = torch.full(shape, norm_init)
            elif name.endswith(".bias"):
                full = torch.zeros(shape)
            else:
                full = torch.randn(*shape, generator=g) * INIT_STD
            if full is not None and experts is not None and (cut := experts(m, ref, tp.layout, tp.coord)):
                full = full[cut[0]:cut[1]]
            set_slice(p, full, shards(m, ref, tp.layout, tp.coord), tp.layout)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 (as transformers' LlamaRMSNorm).

    `tp`: the input is this rank's share of the heads (QK-norm), so the replicated weight's gradient is
    summed over the TP ranks (identity forward, all-reduce backward).
    """

    def __init__(self, dim: int, eps: float, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.eps, self.tp = eps, tp
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.tp is None else copy_to_tp(self.weight, self.tp)
        return weight * h.to(x.dtype)


@functools.lru_cache(maxsize=8)
def sliding_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq] boolean SDPA mask (True = attend): key j is seen by query i when i - window < j <= i.

    Cached: built once per sequence length (and device), not per step. The band is transformers'
    sliding-window mask (`kv_idx > q_idx - sliding_window`, causal).
    """
    i = torch.arange(seq_len, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions; this rank's q heads and their kv heads.

    Options: `qk_norm` (per-head RMSNorm of queries and keys before rotary, replicated across TP) and
    `sliding_window` (each query sees the last W positions).
    """

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.hd, self.window = tp, m.head_dim, m.sliding_window
        self.scale: float | None = None  # SDPA's default 1/sqrt(head_dim); Gemma sets its own
        self.nq, self.nkv = m.n_heads // tp.size, m.kv_heads // tp.size
        self.q = nn.Linear(m.d_model, self.nq * self.hd, bias=m.qkv_bias)
        self.k = nn.Linear(m.d_model, self.nkv * self.hd, bias=m.qkv_bias)
        self.v = nn.Linear(m.d_model, self.nkv * self.hd, bias=m.qkv_bias)
        self.o = nn.Linear(self.nq * self.hd, m.d_model, bias=False)
        self.q_norm = RMSNorm(self.hd, m.rms_norm_eps, tp) if m.qk_norm else None
        self.k_norm = RMSNorm(self.hd, m.rms_norm_eps, tp) if m.qk_norm else None
        # A plain attribute, not a buffer: a bf16 engine must not round the frequencies.
        self.inv_freq = inv_freq(m)
        self.rope_scale = rope_attention_scale(m)

    def forward(self, x: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """`packing`: positions restart per document and attention stays within it (`common.packing`)."""
        b, t, _ = x.shape
        x = copy_to_tp(x, self.tp)
        q = self.q(x).view(b, t, self.nq, self.hd)
        k = self.k(x).view(b, t, self.nkv, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if packing is None:
            freqs = torch.arange(t, device=x.device).float()[:, None] * self.inv_freq.to(x.device)[None, :]
        else:  # [b, 1, t, hd/2]: each sample's own positions, broadcast over the heads
            freqs = packing[0].float()[:, None, :, None] * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.rope_scale).to(x.dtype), (emb.sin() * self.rope_scale).to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.nkv != self.nq:  # GQA: repeat kv heads to match q heads
            k = k.repeat_interleave(self.nq // self.nkv, dim=1)
            v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        y = self.attend(q, k, v, None if packing is None else document_mask(packing))
        return row_parallel(y.transpose(1, 2).reshape(b, t, self.nq * self.hd), self.o, self.tp)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal SDPA of the rotated heads [b, h, t, hd] (banded when a window is shorter than t); `mask`: a
        packed window's document mask [b, 1, t, t] (causal already), banded the same way."""
        t = q.shape[2]
        if mask is not None:
            band = mask if self.window is None or t <= self.window else mask & sliding_mask(t, self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=self.scale)
        if self.window is None or t <= self.window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_mask(t, self.window, q.device),
                                              scale=self.scale)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), act = silu (Gemma: GELU-tanh)."""

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.act: Callable[[torch.Tensor], torch.Tensor] = F.silu
        self.gate = nn.Linear(m.d_model, m.ffn // tp.size, bias=False)
        self.up = nn.Linear(m.d_model, m.ffn // tp.size, bias=False)
        self.down = nn.Linear(m.ffn // tp.size, m.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return row_parallel(self.act(self.gate(x)) * self.up(x), self.down, self.tp)


class Embedding(nn.Module):
    """Vocab-parallel token embedding (no positions: rotary lives in attention). First stage.

    With tied embeddings the last stage holds a second copy (DeepSpeed ties the two)
    and computes the logits with `logits`.
    """

    ref_prefix = EMBED

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        self.tok = VocabParallelEmbedding(m.vocab_size, m.d_model, self.tp)
        init_layer(self, m, 0, seed, self.tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tokens, packing = unpack(inputs)
        return pack(self.tok(tokens), packing)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Local logits [b, s, vocab/tp] through the tied matrix."""
        return vocab_parallel_logits(x, self.tok.weight, self.tp)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)); x + mlp(mlp_norm(x))."""

    def __init__(self, m: ModelConfig, index: int, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.ref_prefix = f"blocks.{index}"
        self.attn_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.attn = Attention(m, tp)
        self.mlp_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.mlp = MLP(m, tp)
        init_layer(self, m, index + 1, seed, tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`inputs`: the activations, or (activations, position_ids, doc_ids) of a packed window."""
        x, packing = unpack(inputs)
        x = x + self.attn(self.attn_norm(x), packing)
        return pack(x + self.mlp(self.mlp_norm(x)), packing)


class Head(nn.Module):
    """Final RMSNorm + untied vocab-parallel LM head (local logits). Tied: the norm only. Last stage."""

    ref_prefix = HEAD

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.out = None if m.tie_embeddings else VocabParallelHead(m.d_model, m.vocab_size, tp)
        init_layer(self, m, m.n_layers + 1, seed, tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = self.norm(unpack(inputs)[0])
        return x if self.out is None else self.out(x)


class Reference(common.Reference):
    """The whole Llama model in one module (tp=1: full logits)."""

    Embedding, TransformerBlock, Head = Embedding, TransformerBlock, Head


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup,
                    reference: type[common.Reference] = Reference) -> list[object]:
    """DeepSpeed LayerSpecs [Embedding, n_layers x TransformerBlock, Head] (+ the tied embedding's logits).

    `reference`: the family whose layer classes to place (Gemma: its own on Llama's plan).

    Tied embeddings: the embedding is a TiedLayerSpec keyed "embed" at both ends;
    DeepSpeed builds one module when both ends share a stage, else one per end
    stage, broadcasts the weight from the first and all-reduces its gradient.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if not m.tie_embeddings:
        return common.pipeline_specs(reference, m, seed, tp)
    embedding = reference.Embedding
    return [
        TiedLayerSpec(EMBED, embedding, m, seed, tp, tied_weight_attr=[TIED]),
        *(LayerSpec(reference.TransformerBlock, m, i, seed, tp) for i in range(m.n_layers)),
        LayerSpec(reference.Head, m, seed, tp),
        TiedLayerSpec(EMBED, embedding, m, seed, tp, forward_fn=common.tied_logits, tied_weight_attr=[TIED]),
    ]


def make_loss_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(local_logits, labels) for the PipelineModule: vocab-parallel mean cross entropy."""

    def loss_fn(local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, labels, tp)

    return loss_fn


def make_token_nll_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """token_nll(local_logits, labels) -> per-token cross entropy (evaluation), from vocab-parallel logits."""
    return lambda local_logits, labels: vocab_parallel_token_nll(local_logits, labels, tp)
