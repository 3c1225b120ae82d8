"""Gemma Hugging Face mapping: tensor names (four norms per layer) and config.json in and out."""

from __future__ import annotations

import re
from typing import Any

from tasks.config import ModelConfig
from tasks.errors import InvalidInputError
from tasks.models.common import BLOCK
from tasks.models.gemma.model import is_sliding
from tasks.models.llama import hf as llama_hf

# architecture -> (model_type, the HF defaults of the keys a config.json may leave out, QK-norm).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma3ForCausalLM": ("gemma3_text", {
        "max_position_embeddings": 131072, "head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "hidden_activation": "gelu_pytorch_tanh",
    }),
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp_norm.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_HF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SLIDING, _FULL = "sliding_attention", "full_attention"


def hf_name(ref_name: str) -> str:
    """`blocks.3.mlp_norm.weight` -> `model.layers.3.pre_feedforward_layernorm.weight`; embedding/head as Llama."""
    match = BLOCK.fullmatch(ref_name)
    if match:
        if match.group(2) not in _BLOCK_NAMES:
            raise ValueError(f"{ref_name!r} is not a Gemma parameter name")
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return llama_hf.hf_name(ref_name)


def ref_name(hf_name: str) -> str:
    """The inverse of `hf_name`; a foreign name is refused."""
    match = _HF_LAYER.fullmatch(hf_name)
    if match:
        if match.group(2) not in _HF_BLOCK:
            raise ValueError(f"{hf_name!r} is not a tensor of a supported Gemma checkpoint")
        return f"blocks.{match.group(1)}.{_HF_BLOCK[match.group(2)]}"
    return llama_hf.ref_name(hf_name)


def layer_types(m: ModelConfig) -> list[str]:
    """HF `layer_types`: which layers slide."""
    return [_SLIDING if is_sliding(m, i) else _FULL for i in range(m.n_layers)]


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: Gemma3ForCausalLM, every Gemma option written back."""
    if not m.qk_norm:
        raise ValueError("model.family 'gemma3' needs model.qk_norm: true (Gemma 3 always normalizes q and k)")
    if m.qkv_bias:
        raise ValueError("model.qkv_bias is not supported by model.family 'gemma3'")
    cfg = llama_hf.base_hf_config(m, "Gemma3ForCausalLM", "gemma3_text", dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    del cfg["hidden_act"]
    window = m.sliding_window
    cfg.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
               query_pre_attn_scalar=m.query_pre_attn_scalar or m.head_dim,
               sliding_window=window, layer_types=layer_types(m),
               rope_local_base_freq=m.rope_local_base_freq or m.rope_theta,
               final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
    return cfg


def _pattern(types: list[str], key: str) -> int | None:
    """`sliding_window_pattern` of a `layer_types` list: None = all slide; N = layers N, 2N, ... are global."""
    if any(t not in (_SLIDING, _FULL) for t in types):
        raise InvalidInputError(f"config.json {key}: only {_SLIDING!r} and {_FULL!r} are supported")
    if _FULL not in types:
        return None
    n = types.index(_FULL) + 1
    if types != [_FULL if (i + 1) % n == 0 else _SLIDING for i in range(len(types))]:
        raise InvalidInputError(f"config.json {key}: only every Nth layer global is supported, got {types}")
    return n


def _rope(c: dict[str, Any]) -> tuple[float, float]:
    """(global rope_theta, local base) from v5's per-layer-type rope_parameters or the flat keys; only default
    rotary (no scaling) is supported."""
    params = c.get("rope_parameters") or {}
    full, local = params.get(_FULL) or {}, params.get(_SLIDING) or {}
    for key, p in (("rope_scaling", c.get("rope_scaling") or {}), (f"rope_parameters.{_FULL}", full),
                   (f"rope_parameters.{_SLIDING}", local)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise InvalidInputError(f"config.json {key}.rope_type {kind!r} is not supported (default only)")
    return float(full.get("rope_theta", c["rope_theta"])), float(local.get("rope_theta", c["rope_local_base_freq"]))


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 config.json; an option the blocks do not implement is refused."""
    arch = (config.get("architectures") or [None])[0]
    c = {**ARCHITECTURES.get(arch, ("", {}))[1], **config}
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise InvalidInputError(f"config.json hidden_activation = {act!r} is not supported by model.family "
                                "'gemma3' (gelu_pytorch_tanh)")
    theta, local = _rope(c)
    plain = {k: v for k, v in config.items()
             if k not in ("hidden_act", "hidden_activation", "rope_parameters", "rope_scaling", "rope_theta")}
    _, c, fields = llama_hf.read_config({**plain, "rope_theta": theta}, "gemma3", ARCHITECTURES)
    llama_hf.refuse(c, "gemma3", {
        "attention_bias": bool(c["attention_bias"]),
        "final_logit_softcapping": c["final_logit_softcapping"] is not None,
        "attn_logit_softcapping": c["attn_logit_softcapping"] is not None,
        "use_bidirectional_attention": bool(c["use_bidirectional_attention"]),
    })
    n = c["num_hidden_layers"]
    if c.get("layer_types") is not None:
        pattern = _pattern(list(c["layer_types"]), "layer_types")
    else:
        pattern = c["sliding_window_pattern"]
    window = c["sliding_window"]
    if pattern is not None and pattern > n:
        pattern = None  # no layer is global: the same model as every layer sliding
    scalar = int(c["query_pre_attn_scalar"])
    # The options' null states the same maths as these values: null keeps the experiment key of a plain model.
    return {**fields, "qk_norm": True, "sliding_window": window, "sliding_window_pattern": pattern,
            "rope_local_base_freq": None if local == theta else local,
            "query_pre_attn_scalar": None if scalar == fields["head_dim"] else scalar}
