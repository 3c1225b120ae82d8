"""The rotary dense decoder's Hugging Face mapping (Llama's, which the other rotary families extend): tensor
names, the config.json keys every llama-style family writes and reads, rope types read and refused."""

from __future__ import annotations

import re
from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.config.model import ROPE_FIELDS, ModelConfig
from tasks.families import FAMILIES
from tasks.models.common.names import BLOCK
from tasks.models.family import EMBED, HEAD

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
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # the qk_norm option's (Qwen3)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
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
    match = BLOCK.fullmatch(ref_name)
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


_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "rope_theta": 10000.0,
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def base_hf_config(m: ModelConfig, architecture: str, model_type: str, *, dtype: str,
                   max_position_embeddings: int | None, bos_token_id: int | None,
                   eos_token_id: int | list[int] | None) -> dict[str, Any]:
    """The config.json keys every llama-style family writes (a family adds its own options).

    rope_theta/rope_scaling are written in the long-standing flat form that transformers 4 and 5
    and vLLM all read. `max_position_embeddings` defaults to model.seq_len; pass the parent's value
    to keep an imported model's context length.
    """
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "num_hidden_layers": m.n_layers,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": max_position_embeddings or m.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": m.rope_scaling.model_dump(exclude_none=True) if m.rope_scaling else None,
        "tie_word_embeddings": m.tie_embeddings,
        "dtype": dtype,  # transformers 5 writes `dtype` (`torch_dtype` is its deprecated spelling)
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def hf_rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """The model's rotary as transformers 5 writes it: `rope_theta` inside the scaling dict (`rope_type` default
    when unscaled)."""
    scaling = m.rope_scaling.model_dump(exclude_none=True) if m.rope_scaling else {"rope_type": "default"}
    return {**scaling, "rope_theta": m.rope_theta}


def _rope(config: dict[str, Any], family: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling fields) from the flat form (rope_theta + rope_scaling) or v5's rope_parameters;
    a rope type the family does not implement (its spec's rope_types, tasks/families) is refused, naming it."""
    params = config.get("rope_parameters") or {}
    if params and "rope_type" not in params and "type" not in params and "rope_theta" not in params:
        raise InvalidInputError("config.json rope_parameters: per-layer-type RoPE is not supported")
    theta = float(params.get("rope_theta", config.get("rope_theta", _COMMON_DEFAULTS["rope_theta"])))
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    scaling = config.get("rope_scaling") or params
    if scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidInputError("config.json partial_rotary_factor: only full rotary (1.0) is supported")
    return theta, rope_scaling(scaling, key, family)


# Keys of a yarn config.json that change its maths in ways we do not implement -> the only value accepted.
_YARN_FIXED: dict[str, object] = {"mscale": None, "mscale_all_dim": None, "truncate": True}


def rope_scaling(scaling: dict[str, Any], key: str, family: str) -> dict[str, Any] | None:
    """The `model.rope_scaling` of a config.json rope dict at `key` (None: default rotary); a type `family`
    does not implement, or a key of it we do not, is refused naming it and the supported ones."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in FAMILIES[family].rope_types:
        raise InvalidInputError(f"config.json {key}.rope_type {kind!r} is not supported by model.family {family!r} "
                                f"(supported: {FAMILIES[family].rope_types_text()})")
    required, optional = ROPE_FIELDS[kind]
    missing = [k for k in ("factor", *required) if scaling.get(k) is None]
    if missing:
        raise InvalidInputError(f"config.json {key}: {kind} needs {', '.join(missing)}")
    if kind == "yarn":
        for fixed, value in _YARN_FIXED.items():
            if scaling.get(fixed, value) != value:
                raise InvalidInputError(f"config.json {key}.{fixed} = {scaling[fixed]!r} is not supported "
                                        f"(yarn with {', '.join(('factor', *required, *optional))} only)")
    fields = ("factor", *required, *optional)
    return {"rope_type": kind, **{k: scaling[k] for k in fields if scaling.get(k) is not None}}


def read_config(config: dict[str, Any], family: str,
                architectures: dict[str, tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(model_type, config.json with the HF defaults filled in, the ModelConfig fields every llama-style
    family reads); an architecture, key or value the blocks do not implement is refused, naming it."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in architectures:
        raise InvalidInputError(
            f"config.json architectures {archs!r} is not supported by model.family {family!r} "
            f"(supported: {', '.join(architectures)})"
        )
    model_type, arch_defaults = architectures[archs[0]]
    if config.get("model_type", model_type) != model_type:
        raise InvalidInputError(f"config.json model_type {config['model_type']!r} does not match {archs[0]}")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise InvalidInputError(f"config.json lacks {', '.join(missing)}")
    c = {**_COMMON_DEFAULTS, **arch_defaults, **config}
    refuse(c, family, {"hidden_act": c["hidden_act"] != "silu", "mlp_bias": bool(c["mlp_bias"]),
                       "attention_dropout": bool(c["attention_dropout"])})
    heads = c["num_attention_heads"]
    theta, scaling = _rope(c, family)
    return model_type, c, {
        "family": family,
        "vocab_size": c["vocab_size"],
        "seq_len": c["max_position_embeddings"],
        "n_layers": c["num_hidden_layers"],
        "d_model": c["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": c.get("num_key_value_heads") or heads,
        "d_ff": c["intermediate_size"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "dropout": 0.0,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": c["rms_norm_eps"],
        "tie_embeddings": bool(c["tie_word_embeddings"]),
    }


def refuse(c: dict[str, Any], family: str, unsupported: dict[str, bool]) -> None:
    """Fail on the first config.json key whose value the family does not implement."""
    for key, bad in unsupported.items():
        if bad:
            raise InvalidInputError(f"config.json {key} = {c[key]!r} is not supported by model.family {family!r}")
