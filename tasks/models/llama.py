"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2 with `qkv_bias`).

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

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config import ModelConfig
from tasks.errors import InvalidInputError
from tasks.models.parallel import (
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    copy_to_tp,
    row_parallel,
    set_slice,
    shard_range,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
    vocab_parallel_token_nll,
)
from tasks.plan.shapes import ParamCounts

INIT_STD = 0.02
# The embedding and LM head are split by vocab rows across TP ranks (the planner counts their collectives).
VOCAB_PARALLEL = True
# Reference-model prefixes of the pipeline layers: the names weights are read and exported by (tasks/models/weights.py).
EMBED, HEAD = "embed", "head"
TIED = "tok.weight"  # the embedding attribute DeepSpeed ties between the first and last stage


def _gen(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + layer)


# ---- shapes and shard rules (the one place they are stated) ----------------------------------


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


_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _split_dim(m: ModelConfig, name: str) -> tuple[int, int, str] | None:
    """(dim, full size, config field) along which `name` is TP-sharded; None = replicated."""
    if name in (f"{EMBED}.tok.weight", f"{HEAD}.out.weight"):
        return 0, m.vocab_size, "model.vocab_size"
    match = _BLOCK.fullmatch(name)
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


def shard_spec(m: ModelConfig, name: str, tp_rank: int, tp_size: int) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of the full tensor `name` (a reference name) held by a TP rank; None = replicated.

    Every split is one contiguous range: heads (q/k/v rows, o columns), the MLP's
    hidden units (gate/up rows, down columns) and the vocab rows (embedding, head).
    """
    split = _split_dim(m, name)
    if split is None:
        return None
    dim, size, field = split
    start, end = shard_range(size, tp_rank, tp_size, field)
    return dim, torch.arange(start, end)


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble a full tensor from its TP pieces (ordered by TP rank)."""
    split = _split_dim(m, name)
    if split is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=split[0])


def _held(m: ModelConfig, name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of `name` one TP rank holds."""
    split = _split_dim(m, name)
    if split is None:
        return math.prod(shape)
    shard_range(split[1], 0, tp, split[2])  # refuses an uneven split, naming the field
    return math.prod(shape) // tp


# ---- counts for the planner and telemetry ------------------------------------------------------


def param_counts(m: ModelConfig, tp: int = 1) -> ParamCounts:
    """Parameters one TP rank holds per layer kind, as DeepSpeed places them.

    embedding: vocab/tp rows x d. block: norms replicated, q/k/v/o and gate/up/down
    sharded. head: final norm + the vocab/tp x d LM head. With tied embeddings the
    head's matrix is DeepSpeed's tied copy of the embedding (TiedLayerSpec): it is
    counted on stage 0 *and* on the last stage, since with pp > 1 both stages hold
    it (and its optimizer states). With pp == 1 the two are one tensor: a stage
    holding both layers holds `embedding` fewer parameters than the sum.
    """
    held = {EMBED: 0, "blocks": 0, HEAD: 0}
    for name, shape in full_shapes(m).items():
        kind = name.split(".", 1)[0]
        if kind != "blocks" or name.startswith("blocks.0."):
            held[kind] += _held(m, name, shape, tp)
    embedding = held[EMBED]
    return ParamCounts(
        embedding=embedding,
        block=held["blocks"],
        head=held[HEAD] + (embedding if m.tie_embeddings else 0),
    )


def total_params(m: ModelConfig) -> int:
    """Unique parameters of the whole model (a tied matrix once), as transformers counts them."""
    return sum(math.prod(s) for s in full_shapes(m).values())


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token, PaLM appendix B / Megatron style: 6N + 12 * n_layers * seq_len * d_model.

    N = the parameters that take part in matmuls: all blocks plus the head (final
    norm + the d x vocab LM-head matrix, counted even when tied, because the
    logits matmul runs either way); the input embedding is a lookup and is left
    out. The attention term counts QK^T and AV over the full (not causal-halved)
    seq_len x seq_len score matrix, n_heads * head_dim = d_model wide.
    """
    c = param_counts(m, 1)
    n = m.n_layers * c.block + c.head
    return 6.0 * n + 12.0 * m.n_layers * m.seq_len * m.d_model


# ---- layers ------------------------------------------------------------------------------------


def _init(layer: nn.Module, m: ModelConfig, seed_layer: int, seed: int | None, tp: TPGroup) -> None:
    """Fill the layer's parameters in order from its own generator, one full tensor at a time, keeping our slice.

    Linear weights and the embedding ~ N(0, 0.02); norms 1; q/k/v biases 0. `seed` None: no draw (the
    weights are loaded next: a resume or starting weights), only the tensor-parallel marks.
    """
    g = None if seed is None else _gen(seed, seed_layer)
    shapes = full_shapes(m)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            ref = f"{layer.ref_prefix}.{name}"
            shape = shapes[ref]
            if g is None:
                full = None
            elif name.endswith("norm.weight"):
                full = torch.ones(shape)
            elif name.endswith(".bias"):
                full = torch.zeros(shape)
            else:
                full = torch.randn(*shape, generator=g) * INIT_STD
            set_slice(p, full, shard_spec(m, ref, tp.rank, tp.size), tp.size)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inv_freq(m: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies in fp32, exactly as transformers' default and `llama3` rope init compute them."""
    dim = m.head_dim
    freq = 1.0 / (m.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = m.rope_scaling
    if rs is None:
        return freq
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / rs.low_freq_factor, old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / rs.factor, freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions; this rank's q heads and their kv heads."""

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.hd = tp, m.head_dim
        self.nq, self.nkv = m.n_heads // tp.size, m.kv_heads // tp.size
        self.q = nn.Linear(m.d_model, self.nq * self.hd, bias=m.qkv_bias)
        self.k = nn.Linear(m.d_model, self.nkv * self.hd, bias=m.qkv_bias)
        self.v = nn.Linear(m.d_model, self.nkv * self.hd, bias=m.qkv_bias)
        self.o = nn.Linear(self.nq * self.hd, m.d_model, bias=False)
        # A plain attribute, not a buffer: a bf16 engine must not round the frequencies.
        self.inv_freq = inv_freq(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = copy_to_tp(x, self.tp)
        q = self.q(x).view(b, t, self.nq, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        freqs = torch.arange(t, device=x.device).float()[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.nkv != self.nq:  # GQA: repeat kv heads to match q heads
            k = k.repeat_interleave(self.nq // self.nkv, dim=1)
            v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return row_parallel(y.transpose(1, 2).reshape(b, t, self.nq * self.hd), self.o, self.tp)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate = nn.Linear(m.d_model, m.ffn // tp.size, bias=False)
        self.up = nn.Linear(m.d_model, m.ffn // tp.size, bias=False)
        self.down = nn.Linear(m.ffn // tp.size, m.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return row_parallel(F.silu(self.gate(x)) * self.up(x), self.down, self.tp)


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
        _init(self, m, 0, seed, self.tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Local logits [b, s, vocab/tp] through the tied matrix."""
        return vocab_parallel_logits(x, self.tok.weight, self.tp)


def tied_logits(embed: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The last stage's forward of the tied embedding (DeepSpeed TiedLayerSpec forward_fn)."""
    return embed.logits(x)


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
        _init(self, m, index + 1, seed, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """Final RMSNorm + untied vocab-parallel LM head (local logits). Tied: the norm only. Last stage."""

    ref_prefix = HEAD

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.norm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.out = None if m.tie_embeddings else VocabParallelHead(m.d_model, m.vocab_size, tp)
        _init(self, m, m.n_layers + 1, seed, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return x if self.out is None else self.out(x)


class Reference(nn.Module):
    """The whole model in one module: the yardstick (tp=1: full logits); its state dict uses the reference names."""

    def __init__(self, m: ModelConfig, seed: int | None = 0, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed = Embedding(m, seed, tp)
        self.blocks = nn.ModuleList(TransformerBlock(m, i, seed, tp) for i in range(m.n_layers))
        self.head = Head(m, seed, tp)
        self.tied = m.tie_embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.head(x)
        return self.embed.logits(x) if self.tied else x


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """DeepSpeed LayerSpecs [Embedding, n_layers x TransformerBlock, Head] (+ the tied embedding's logits).

    Tied embeddings: the embedding is a TiedLayerSpec keyed "embed" at both ends;
    DeepSpeed builds one module when both ends share a stage, else one per end
    stage, broadcasts the weight from the first and all-reduces its gradient.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    blocks = [LayerSpec(TransformerBlock, m, i, seed, tp) for i in range(m.n_layers)]
    if not m.tie_embeddings:
        return [LayerSpec(Embedding, m, seed, tp), *blocks, LayerSpec(Head, m, seed, tp)]
    return [
        TiedLayerSpec(EMBED, Embedding, m, seed, tp, tied_weight_attr=[TIED]),
        *blocks,
        LayerSpec(Head, m, seed, tp),
        TiedLayerSpec(EMBED, Embedding, m, seed, tp, forward_fn=tied_logits, tied_weight_attr=[TIED]),
    ]


def make_loss_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(local_logits, labels) for the PipelineModule: vocab-parallel mean cross entropy."""

    def loss_fn(local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, labels, tp)

    return loss_fn


def make_token_nll_fn(tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """token_nll(local_logits, labels) -> per-token cross entropy (evaluation), from vocab-parallel logits."""
    return lambda local_logits, labels: vocab_parallel_token_nll(local_logits, labels, tp)


# ---- Hugging Face mapping ----------------------------------------------------------------------

_TOP_NAMES = {
    f"{EMBED}.tok.weight": "model.embed_tokens.weight",
    f"{HEAD}.norm.weight": "model.norm.weight",
    f"{HEAD}.out.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.v.bias": "self_attn.v_proj.bias",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_HF_TOP = {v: k for k, v in _TOP_NAMES.items()}
_HF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(ref_name: str) -> str:
    """Hugging Face name of a reference name: `blocks.3.attn.q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if ref_name in _TOP_NAMES:
        return _TOP_NAMES[ref_name]
    match = _BLOCK.fullmatch(ref_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise ValueError(f"{ref_name!r} is not a Llama-family parameter name")


def ref_name(hf_name: str) -> str:
    """Reference name of a Hugging Face tensor name (the inverse of `hf_name`)."""
    if hf_name in _HF_TOP:
        return _HF_TOP[hf_name]
    match = _HF_LAYER.fullmatch(hf_name)
    if match and match.group(2) in _HF_BLOCK:
        return f"blocks.{match.group(1)}.{_HF_BLOCK[match.group(2)]}"
    raise ValueError(f"{hf_name!r} is not a tensor of a supported Llama-family checkpoint")


# Architectures we read, with the HF defaults of the keys a config.json may leave out.
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {"max_position_embeddings": 2048}),
    "MistralForCausalLM": ("mistral", {"max_position_embeddings": 131072, "sliding_window": 4096}),
    "Qwen2ForCausalLM": ("qwen2", {"max_position_embeddings": 32768}),
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "rope_theta": 10000.0,
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: LlamaForCausalLM, or Qwen2ForCausalLM when `qkv_bias`.

    Why Qwen2 for qkv_bias: Llama's `attention_bias` also puts a bias on o_proj,
    which this model does not have. rope_theta/rope_scaling are written in the
    long-standing flat form that transformers 4 and 5 and vLLM all read.
    `max_position_embeddings` defaults to model.seq_len; pass the parent's value to
    keep an imported model's context length.
    """
    qwen = m.qkv_bias
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "num_hidden_layers": m.n_layers,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": max_position_embeddings or m.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": m.rope_scaling.model_dump() if m.rope_scaling else None,
        "tie_word_embeddings": m.tie_embeddings,
        "dtype": dtype,  # transformers 5 writes `dtype` (`torch_dtype` is its deprecated spelling)
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if qwen:
        cfg["use_sliding_window"] = False
    else:
        cfg.update(attention_bias=False, mlp_bias=False, head_dim=m.head_dim)
    return cfg


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling fields) from the flat form (rope_theta + rope_scaling) or v5's rope_parameters."""
    params = config.get("rope_parameters") or {}
    if params and "rope_type" not in params and "type" not in params and "rope_theta" not in params:
        raise InvalidInputError("config.json rope_parameters: per-layer-type RoPE is not supported")
    theta = float(params.get("rope_theta", config.get("rope_theta", _COMMON_DEFAULTS["rope_theta"])))
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidInputError("config.json partial_rotary_factor: only full rotary (1.0) is supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise InvalidInputError(f"config.json {key}.rope_type {kind!r} is not supported (default or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise InvalidInputError(f"config.json {key}: llama3 needs {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields implied by a Hugging Face config.json; unsupported features fail naming the key."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in _ARCHITECTURES:
        raise InvalidInputError(
            f"config.json architectures {archs!r} is not supported by model.family 'llama' "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    model_type, arch_defaults = _ARCHITECTURES[archs[0]]
    if config.get("model_type", model_type) != model_type:
        raise InvalidInputError(f"config.json model_type {config['model_type']!r} does not match {archs[0]}")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise InvalidInputError(f"config.json lacks {', '.join(missing)}")
    c = {**_COMMON_DEFAULTS, **arch_defaults, **config}
    heads = c["num_attention_heads"]
    unsupported = {
        "hidden_act": c["hidden_act"] != "silu",
        "head_dim": c.get("head_dim") not in (None, c["hidden_size"] // heads),
        "mlp_bias": bool(c["mlp_bias"]),
        "attention_bias": model_type != "qwen2" and bool(c["attention_bias"]),  # Llama's puts a bias on o_proj too
        "attention_dropout": bool(c["attention_dropout"]),
        "use_sliding_window": model_type == "qwen2" and bool(c["use_sliding_window"]),
        "sliding_window": model_type == "mistral" and c["sliding_window"] is not None,
    }
    for key, bad in unsupported.items():
        if bad:
            raise InvalidInputError(f"config.json {key} = {c[key]!r} is not supported by model.family 'llama'")
    theta, scaling = _rope(c)
    return {
        "family": "llama",
        "vocab_size": c["vocab_size"],
        "seq_len": c["max_position_embeddings"],
        "n_layers": c["num_hidden_layers"],
        "d_model": c["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": c.get("num_key_value_heads") or heads,
        "d_ff": c["intermediate_size"],
        "dropout": 0.0,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": c["rms_norm_eps"],
        "tie_embeddings": bool(c["tie_word_embeddings"]),
        "qkv_bias": model_type == "qwen2",
    }
