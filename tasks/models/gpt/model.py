"""The GPT family's layers: a GPT-2-style decoder, one set of layer classes for the 3D pipeline and the reference.

Why one set: the planner, the 3D-equality tests and `evaluate` all rely on the
pipeline and the reference being the same maths with the same parameter names.
Each layer draws its full-size initial weights from its own seeded generator
(seed, layer index) and a tensor-parallel rank keeps only its slice, so any
(tp, pp, dp) layout starts from the same weights as the reference.

Architecture (the planner's contract): pre-LN blocks; fused QKV column-parallel
linear sharded by heads; causal SDPA; row-parallel output projection whose bias
is added after the all-reduce; column/row-parallel GELU MLP; untied LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config.model import ModelConfig
from tasks.models.common import reference as common
from tasks.models.common.init import layer_generator
from tasks.models.common.packing import Packing, document_mask, pack, unpack
from tasks.models.family import EMBED, HEAD
from tasks.models.gpt.sharding import shard_spec
from tasks.models.parallel import CopyToTP as _CopyToTP
from tasks.models.parallel import TPGroup, set_slice
from tasks.models.parallel import row_parallel as _row_parallel

INIT_STD = 0.02


def _normal(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * INIT_STD


class Embedding(nn.Module):
    """Token + learned position embeddings, dropout. First pipeline stage; not TP-sharded."""

    ref_prefix = EMBED

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:  # tp: replicated
        super().__init__()
        self.tok = nn.Embedding(m.vocab_size, m.d_model)
        self.pos = nn.Embedding(m.seq_len, m.d_model)
        self.drop = nn.Dropout(m.dropout)
        if seed is None:  # weights are loaded next
            return
        g = layer_generator(seed, 0)
        with torch.no_grad():
            self.tok.weight.copy_(_normal(g, m.vocab_size, m.d_model))
            self.pos.weight.copy_(_normal(g, m.seq_len, m.d_model))

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tokens, packing = unpack(inputs)
        pos = torch.arange(tokens.shape[1], device=tokens.device) if packing is None else packing[0]
        return pack(self.drop(self.tok(tokens) + self.pos(pos)), packing)


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.dropout = tp, m.dropout
        self.hd = m.head_dim
        self.nq, self.nkv = m.n_heads // tp.size, m.kv_heads // tp.size
        self.qkv = nn.Linear(m.d_model, (self.nq + 2 * self.nkv) * self.hd)
        self.out = nn.Linear(self.nq * self.hd, m.d_model)

    def forward(self, x: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if self.tp.size > 1:
            x = _CopyToTP.apply(x, self.tp)
        qkv = self.qkv(x)
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(b, t, self.nq, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.nkv != self.nq:  # GQA: repeat kv heads to match q heads
            k = k.repeat_interleave(self.nq // self.nkv, dim=1)
            v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        mask = None if packing is None else document_mask(packing)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, self.nq * self.hd)
        return _row_parallel(y, self.out, self.tp)


class MLP(nn.Module):
    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.fc1 = nn.Linear(m.d_model, m.ffn // tp.size)
        self.fc2 = nn.Linear(m.ffn // tp.size, m.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            x = _CopyToTP.apply(x, self.tp)
        return _row_parallel(F.gelu(self.fc1(x)), self.fc2, self.tp)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + drop(attn(ln1(x))); x + drop(mlp(ln2(x)))."""

    def __init__(self, m: ModelConfig, index: int, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.ref_prefix = f"blocks.{index}"
        self.ln1 = nn.LayerNorm(m.d_model)
        self.attn = Attention(m, tp)
        self.ln2 = nn.LayerNorm(m.d_model)
        self.mlp = MLP(m, tp)
        self.drop = nn.Dropout(m.dropout)
        self._init(m, index, seed, tp)

    def _init(self, m: ModelConfig, index: int, seed: int | None, tp: TPGroup) -> None:
        if seed is None:  # weights are loaded next: only the tensor-parallel marks
            for name, p in self.named_parameters():
                set_slice(p, None, shard_spec(m, name, tp.layout, tp.coord), tp.layout)
            return
        g = layer_generator(seed, index + 1)
        d, qkv_out, attn_in = m.d_model, (m.n_heads + 2 * m.kv_heads) * m.head_dim, m.n_heads * m.head_dim
        full = {
            "attn.qkv.weight": _normal(g, qkv_out, d),
            "attn.out.weight": _normal(g, d, attn_in),
            "mlp.fc1.weight": _normal(g, m.ffn, d),
            "mlp.fc2.weight": _normal(g, d, m.ffn),
        }
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                if name in full:
                    value = full[name]
                elif name.endswith("bias"):
                    value = torch.zeros(_full_shape(m, name))
                else:  # LayerNorm weight
                    value = torch.ones(_full_shape(m, name))
                set_slice(p, value, shard_spec(m, name, tp.layout, tp.coord), tp.layout)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x, packing = unpack(inputs)
        x = x + self.drop(self.attn(self.ln1(x), packing))
        return pack(x + self.drop(self.mlp(self.ln2(x))), packing)


def _full_shape(m: ModelConfig, name: str) -> tuple[int, ...]:
    shapes = {
        "attn.qkv.bias": ((m.n_heads + 2 * m.kv_heads) * m.head_dim,),
        "mlp.fc1.bias": (m.ffn,),
    }
    return shapes.get(name, (m.d_model,))


class Head(nn.Module):
    """Final LayerNorm + untied LM head (no bias). Last pipeline stage; replicated across TP."""

    ref_prefix = HEAD

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:  # tp: replicated
        super().__init__()
        self.ln = nn.LayerNorm(m.d_model)
        self.out = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if seed is None:  # weights are loaded next
            return
        with torch.no_grad():
            self.out.weight.copy_(_normal(layer_generator(seed, m.n_layers + 1), m.vocab_size, m.d_model))

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.out(self.ln(unpack(inputs)[0]))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_loss_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(logits, labels) for the PipelineModule: the head is replicated, so the logits are full."""
    return lm_loss


def make_token_nll_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """token_nll(logits, labels) -> per-token cross entropy in fp32 (evaluation); the logits are full."""
    return lambda logits, labels: F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  reduction="none").reshape(labels.shape)


class Reference(common.Reference):
    """The whole GPT model in one module (never tied: the family has no tied head)."""

    Embedding, TransformerBlock, Head = Embedding, TransformerBlock, Head
    can_tie = False


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """DeepSpeed LayerSpecs: embedding, n_layers blocks, head (built lazily on the owning stage)."""
    return common.pipeline_specs(Reference, m, seed, tp)
