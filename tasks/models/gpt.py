"""The GPT family: a GPT-2-style decoder, one set of layer classes for the 3D pipeline and the reference.

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

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config import ModelConfig
from tasks.errors import InvalidInputError
from tasks.models.parallel import CopyToTP as _CopyToTP
from tasks.models.parallel import TPGroup, set_slice
from tasks.models.parallel import row_parallel as _row_parallel
from tasks.plan.shapes import ParamCounts

INIT_STD = 0.02
# The embedding and LM head are split by vocab rows across TP ranks (the planner counts their collectives).
VOCAB_PARALLEL = False
# Reference-model prefixes of the pipeline layers: the names weights are read and exported by (tasks/models/weights.py).
EMBED, HEAD = "embed", "head"


def _gen(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + layer)


def _normal(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * INIT_STD


def qkv_rows(m: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Row indices of the full fused QKV weight that a TP rank owns (its q, k and v heads)."""
    hd, nq, nkv = m.head_dim, m.n_heads, m.kv_heads
    q_per, kv_per = nq // tp_size, nkv // tp_size
    q = torch.arange(tp_rank * q_per * hd, (tp_rank + 1) * q_per * hd)
    k = nq * hd + torch.arange(tp_rank * kv_per * hd, (tp_rank + 1) * kv_per * hd)
    v = (nq + nkv) * hd + torch.arange(tp_rank * kv_per * hd, (tp_rank + 1) * kv_per * hd)
    return torch.cat([q, k, v])


_BLOCK = re.compile(r"blocks\.\d+\.(.+)")


def _relative(name: str) -> str:
    match = _BLOCK.fullmatch(name)
    return match.group(1) if match else name


def shard_spec(m: ModelConfig, name: str, tp_rank: int, tp_size: int) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of the full tensor `name` (a reference name) held by a TP rank; None = replicated."""
    name = _relative(name)
    if name in ("attn.qkv.weight", "attn.qkv.bias"):
        return 0, qkv_rows(m, tp_rank, tp_size)
    per_heads = m.n_heads * m.head_dim // tp_size
    per_ff = m.ffn // tp_size
    if name == "attn.out.weight":
        return 1, torch.arange(tp_rank * per_heads, (tp_rank + 1) * per_heads)
    if name in ("mlp.fc1.weight", "mlp.fc1.bias"):
        return 0, torch.arange(tp_rank * per_ff, (tp_rank + 1) * per_ff)
    if name == "mlp.fc2.weight":
        return 1, torch.arange(tp_rank * per_ff, (tp_rank + 1) * per_ff)
    return None


class Embedding(nn.Module):
    """Token + learned position embeddings, dropout. First pipeline stage; not TP-sharded."""

    ref_prefix = EMBED

    def __init__(self, m: ModelConfig, seed: int | None) -> None:
        super().__init__()
        self.tok = nn.Embedding(m.vocab_size, m.d_model)
        self.pos = nn.Embedding(m.seq_len, m.d_model)
        self.drop = nn.Dropout(m.dropout)
        if seed is None:  # weights are loaded next
            return
        g = _gen(seed, 0)
        with torch.no_grad():
            self.tok.weight.copy_(_normal(g, m.vocab_size, m.d_model))
            self.pos.weight.copy_(_normal(g, m.seq_len, m.d_model))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos))


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.dropout = tp, m.dropout
        self.hd = m.head_dim
        self.nq, self.nkv = m.n_heads // tp.size, m.kv_heads // tp.size
        self.qkv = nn.Linear(m.d_model, (self.nq + 2 * self.nkv) * self.hd)
        self.out = nn.Linear(self.nq * self.hd, m.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
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
                set_slice(p, None, shard_spec(m, name, tp.rank, tp.size), tp.size)
            return
        g = _gen(seed, index + 1)
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
                set_slice(p, value, shard_spec(m, name, tp.rank, tp.size), tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def _full_shape(m: ModelConfig, name: str) -> tuple[int, ...]:
    shapes = {
        "attn.qkv.bias": ((m.n_heads + 2 * m.kv_heads) * m.head_dim,),
        "mlp.fc1.bias": (m.ffn,),
    }
    return shapes.get(name, (m.d_model,))


class Head(nn.Module):
    """Final LayerNorm + untied LM head (no bias). Last pipeline stage; replicated across TP."""

    ref_prefix = HEAD

    def __init__(self, m: ModelConfig, seed: int | None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(m.d_model)
        self.out = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if seed is None:  # weights are loaded next
            return
        with torch.no_grad():
            self.out.weight.copy_(_normal(_gen(seed, m.n_layers + 1), m.vocab_size, m.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


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


class Reference(nn.Module):
    """Single-process reference model; its state dict names are the reference names."""

    def __init__(self, m: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.embed = Embedding(m, seed)
        self.blocks = nn.ModuleList(TransformerBlock(m, i, seed) for i in range(m.n_layers))
        self.head = Head(m, seed)
        self.tied = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """DeepSpeed LayerSpecs: embedding, n_layers blocks, head (built lazily on the owning stage)."""
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(Embedding, m, seed),
        *(LayerSpec(TransformerBlock, m, i, seed, tp) for i in range(m.n_layers)),
        LayerSpec(Head, m, seed),
    ]


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble a full tensor from its TP pieces (ordered by TP rank)."""
    tp_size = len(pieces)
    rel = _relative(name)
    spec = shard_spec(m, rel, 0, tp_size)
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


# ---- counts for the planner and telemetry ------------------------------------------------------


def param_counts(m: ModelConfig, tp: int = 1) -> ParamCounts:
    """Per-TP-rank parameter counts: column/row-parallel weights sharded; LayerNorms, row-parallel biases,
    the embeddings (token + learned positions) and the LM head replicated on every TP rank."""
    shapes = full_shapes(m)
    held = {EMBED: 0, "blocks": 0, HEAD: 0}
    for name, shape in shapes.items():
        kind = name.split(".", 1)[0]
        if kind == "blocks" and not name.startswith("blocks.0."):
            continue
        held[kind] += math.prod(shape) // (tp if shard_spec(m, name, 0, 1) is not None else 1)
    return ParamCounts(embedding=held[EMBED], block=held["blocks"], head=held[HEAD])


def total_params(m: ModelConfig) -> int:
    """Exact parameter count of the unsharded model."""
    return sum(math.prod(s) for s in full_shapes(m).values())


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token: 6N over the matmul parameters (blocks + LM head; the embedding lookups
    are left out) plus the attention scores (PaLM appendix B), as in the Llama family."""
    c = param_counts(m, 1)
    return 6.0 * (m.n_layers * c.block + c.head) + 12.0 * m.n_layers * m.seq_len * m.d_model


# ---- export names and config (no transformers class: our own config.json) -----------------------

ARCHITECTURE = "RetrainerGPT"


def hf_name(ref: str) -> str:
    """Exported tensor names are the reference names (there is no Hugging Face GPT of this shape)."""
    return ref


def ref_name(name: str) -> str:
    """The reference name of an exported tensor (the same name); anything else is refused."""
    if _relative(name) not in _GPT_NAMES:
        raise ValueError(f"{name!r} is not a GPT-family tensor name")
    return name


_GPT_NAMES = {
    "embed.tok.weight", "embed.pos.weight", "head.ln.weight", "head.ln.bias", "head.out.weight",
    "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias",
    "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
}
_FIELDS = ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "dropout")


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", **_: Any) -> dict[str, Any]:
    """config.json of an exported GPT: our architecture name and the model fields (read back by
    `model_fields_from_hf`); transformers has no class for it, retrainer's evaluate reads it."""
    return {"architectures": [ARCHITECTURE], "model_type": "retrainer-gpt", "dtype": dtype,
            **{f: getattr(m, f) for f in _FIELDS}}


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("architectures") != [ARCHITECTURE]:
        raise InvalidInputError(f"config.json architectures {config.get('architectures')!r} is not "
                                f"model.family 'gpt' ({ARCHITECTURE})")
    missing = [f for f in _FIELDS if f not in config]
    if missing:
        raise InvalidInputError(f"config.json lacks {', '.join(missing)}")
    return {"family": "gpt", **{f: config[f] for f in _FIELDS}}
