"""Gemma's layers on Llama's: what differs is stated here, the rest (GQA, rotary, shard rules) is Llama's.

Why subclasses: the projections, their tensor-parallel splits and the pipeline plan are the same
maths; Gemma adds x * (1 + w) RMSNorms (weights start at 0), a norm after attention and after the
MLP, a sqrt(d_model)-scaled embedding, GELU-tanh, its own softmax scale and per-layer attention
(every `sliding_window_pattern`-th layer global with `rope_theta`, the others sliding with
`rope_local_base_freq`); Gemma 2 soft-caps attention scores and logits (tanh(x / c) * c).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config.model import ModelConfig
from tasks.models.common import blocks, rotary
from tasks.models.common.packing import pack, unpack
from tasks.models.gemma3.sharding import full_shapes
from tasks.models.parallel import TPGroup, VocabParallelEmbedding, VocabParallelHead, copy_to_tp


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap (elementwise: a vocab-parallel shard caps its own logits); None = x."""
    return x if cap is None else torch.tanh(x / cap) * cap


def is_sliding(m: ModelConfig, index: int) -> bool:
    """Whether block `index` attends to the last `sliding_window` positions (else to all before it)."""
    pattern = m.sliding_window_pattern
    return m.sliding_window is not None and (pattern is None or (index + 1) % pattern != 0)


def _init(layer: nn.Module, m: ModelConfig, seed_layer: int, seed: int | None, tp: TPGroup) -> None:
    blocks.init_layer(layer, m, seed_layer, seed, tp, shapes=full_shapes, norm_init=0.0)


class RMSNorm(blocks.RMSNorm):
    """x / rms(x) * (1 + weight), all in fp32, cast back at the end (transformers' Gemma3RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.tp is None else copy_to_tp(self.weight, self.tp)
        return (h * (1.0 + weight.float())).to(x.dtype)


class Attention(blocks.Attention):
    """Llama's attention with Gemma's QK-norm, scale `query_pre_attn_scalar ** -0.5`, per-layer window/base and
    optional score soft-capping."""

    def __init__(self, m: ModelConfig, index: int, tp: TPGroup) -> None:
        super().__init__(m, tp)
        if m.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.hd, m.rms_norm_eps, tp), RMSNorm(self.hd, m.rms_norm_eps, tp)
        self.scale = (m.query_pre_attn_scalar or m.head_dim) ** -0.5
        sliding = is_sliding(m, index)
        self.window = m.sliding_window if sliding else None
        self.inv_freq = rotary.inv_freq(m, m.rope_local_base_freq or m.rope_theta) if sliding else rotary.inv_freq(m)
        self.softcap = m.attn_logit_softcapping

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """With soft-capping (Gemma 2) SDPA's fused path cannot cap the scores: scores, tanh cap, mask, fp32
        softmax, as transformers' eager attention."""
        if self.softcap is None:
            return super().attend(q, k, v, mask)
        t = q.shape[2]
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        band = blocks.sliding_mask(t, self.window or t, q.device)
        scores = scores.masked_fill(~(band if mask is None else band & mask), float("-inf"))
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class MLP(blocks.MLP):
    """Gated GELU (tanh approximation): down(gelu(gate(x)) * up(x))."""

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__(m, tp)
        self.act = functools.partial(F.gelu, approximate="tanh")


class Embedding(blocks.Embedding):
    """Llama's vocab-parallel embedding, its output scaled by sqrt(d_model) in the weight's dtype (as HF)."""

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        self.tp = tp or TPGroup()
        self.scale, self.cap = math.sqrt(m.d_model), m.final_logit_softcapping
        self.tok = VocabParallelEmbedding(m.vocab_size, m.d_model, self.tp)
        _init(self, m, 0, seed, self.tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tokens, packing = unpack(inputs)
        return pack(self.tok(tokens) * torch.tensor(self.scale, dtype=self.tok.weight.dtype), packing)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Local logits through the tied matrix, soft-capped (`final_logit_softcapping`)."""
        return softcap(super().logits(x), self.cap)


class TransformerBlock(nn.Module):
    """Sandwich-norm block: x + post_attn_norm(attn(attn_norm(x))); x + post_mlp_norm(mlp(mlp_norm(x)))."""

    def __init__(self, m: ModelConfig, index: int, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.ref_prefix = f"blocks.{index}"
        self.attn_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.attn = Attention(m, index, tp)
        self.post_attn_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.mlp_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.mlp = MLP(m, tp)
        self.post_mlp_norm = RMSNorm(m.d_model, m.rms_norm_eps)
        _init(self, m, index + 1, seed, tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x, packing = unpack(inputs)
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), packing))
        return pack(x + self.post_mlp_norm(self.mlp(self.mlp_norm(x))), packing)


class Head(blocks.Head):
    """Final Gemma RMSNorm + (untied) vocab-parallel LM head, its logits soft-capped."""

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        tp = tp or TPGroup()
        self.norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.out = None if m.tie_embeddings else VocabParallelHead(m.d_model, m.vocab_size, tp)
        self.cap = m.final_logit_softcapping
        _init(self, m, m.n_layers + 1, seed, tp)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = self.norm(unpack(inputs)[0])
        return x if self.out is None else softcap(self.out(x), self.cap)


class Reference(blocks.Reference):
    """The whole Gemma model in one module (tp=1: full logits)."""

    Embedding, TransformerBlock, Head = Embedding, TransformerBlock, Head


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """Llama's pipeline plan with Gemma's layers."""
    return blocks.pipeline_layers(m, seed, tp, Reference)
