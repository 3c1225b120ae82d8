"""Gemma Hugging Face mapping: tensor names (four norms per layer) and config.json in and out."""

from __future__ import annotations

import re
from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.config.model import ModelConfig
from tasks.families.gemma2 import GEMMA2
from tasks.families.gemma3 import GEMMA3
from tasks.models.common import hf as common_hf
from tasks.models.common.names import BLOCK
from tasks.models.gemma3.model import is_sliding

_GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 10_000.0, "use_bidirectional_attention": False,
    "hidden_activation": "gelu_pytorch_tanh",
}
# family -> {architecture: (model_type, the HF defaults of the keys a config.json may leave out)}.
ARCHITECTURES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    GEMMA3.name: {GEMMA3.architectures[0]: ("gemma3_text", {
        **_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    })},
    GEMMA2.name: {GEMMA2.architectures[0]: ("gemma2", {
        **_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "sliding_window_pattern": 2,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    })},
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
    return common_hf.hf_name(ref_name)


def ref_name(hf_name: str) -> str:
    """The inverse of `hf_name`; a foreign name is refused."""
    match = _HF_LAYER.fullmatch(hf_name)
    if match:
        if match.group(2) not in _HF_BLOCK:
            raise ValueError(f"{hf_name!r} is not a tensor of a supported Gemma checkpoint")
        return f"blocks.{match.group(1)}.{_HF_BLOCK[match.group(2)]}"
    return common_hf.ref_name(hf_name)


def layer_types(m: ModelConfig) -> list[str]:
    """HF `layer_types`: which layers slide."""
    return [_SLIDING if is_sliding(m, i) else _FULL for i in range(m.n_layers)]


def hf_config(family: str, m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: Gemma3ForCausalLM or Gemma2ForCausalLM, every Gemma option written back."""
    gemma3 = family == GEMMA3.name
    [(architecture, (model_type, _))] = ARCHITECTURES[family].items()
    cfg = common_hf.base_hf_config(m, architecture, model_type, dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    del cfg["hidden_act"]
    cfg.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
               query_pre_attn_scalar=m.query_pre_attn_scalar or m.head_dim, sliding_window=m.sliding_window,
               layer_types=layer_types(m), final_logit_softcapping=m.final_logit_softcapping,
               attn_logit_softcapping=m.attn_logit_softcapping, use_bidirectional_attention=False)
    if gemma3:
        cfg["rope_local_base_freq"] = m.rope_local_base_freq or m.rope_theta
    return cfg


def hf_rope_parameters(family: str, m: ModelConfig) -> dict[str, Any]:
    """The model's rotary as transformers 5 writes it: Gemma 3's per layer type (the sliding layers' own base,
    never scaled), Gemma 2's one dict as Llama's."""
    if family != GEMMA3.name:
        return common_hf.hf_rope_parameters(m)
    local = {"rope_type": "default", "rope_theta": m.rope_local_base_freq or m.rope_theta}
    return {_FULL: common_hf.hf_rope_parameters(m), _SLIDING: local}


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


def _rope(c: dict[str, Any], family: str) -> tuple[float, float, dict[str, Any] | None]:
    """(global rope_theta, local base, global rope_scaling) from v5's rope_parameters (per layer type for Gemma 3)
    or the flat keys (`rope_scaling` applies to the global layers, as transformers reads it); the sliding
    layers' rotary is always default."""
    params = c.get("rope_parameters") or {}
    per_type = _FULL in params or _SLIDING in params
    full, local = (params.get(_FULL) or {}, params.get(_SLIDING) or {}) if per_type else (params, {})
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise InvalidInputError(f"config.json rope_parameters.{_SLIDING}.rope_type {kind!r} is not supported "
                                "(the sliding layers' rotary is never scaled; supported: default)")
    if c.get("rope_scaling"):
        scaling = common_hf.rope_scaling(c["rope_scaling"], "rope_scaling", family)
    else:
        scaling = common_hf.rope_scaling(full, f"rope_parameters.{_FULL}" if per_type else "rope_parameters", family)
    theta = float(full.get("rope_theta", c["rope_theta"]))
    return theta, float(local.get("rope_theta", c.get("rope_local_base_freq", theta))), scaling


def model_fields_from_hf(family: str, config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 / Gemma 2 config.json; an option the blocks do not implement is refused."""
    archs = ARCHITECTURES[family]
    arch = (config.get("architectures") or [None])[0]
    c = {**archs.get(arch, ("", {}))[1], **config}
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise InvalidInputError(f"config.json hidden_activation = {act!r} is not supported by model.family "
                                f"{family!r} (gelu_pytorch_tanh)")
    theta, local, scaling = _rope(c, family)
    plain = {k: v for k, v in config.items()
             if k not in ("hidden_act", "hidden_activation", "rope_parameters", "rope_scaling", "rope_theta")}
    _, c, fields = common_hf.read_config({**plain, "rope_theta": theta}, family, archs)
    common_hf.refuse(c, family, {"attention_bias": bool(c["attention_bias"]),
                                "use_bidirectional_attention": bool(c["use_bidirectional_attention"])})
    n = c["num_hidden_layers"]
    if c.get("layer_types") is not None:
        pattern = _pattern(list(c["layer_types"]), "layer_types")
    else:
        pattern = c["sliding_window_pattern"]
    if pattern is not None and pattern > n:
        pattern = None  # no layer is global: the same model as every layer sliding
    scalar = int(c["query_pre_attn_scalar"])
    # The options' null states the same maths as these values: null keeps the experiment key of a plain model.
    return {**fields, "rope_scaling": scaling, "qk_norm": family == GEMMA3.name, "sliding_window": c["sliding_window"],
            "sliding_window_pattern": pattern, "rope_local_base_freq": None if local == theta else local,
            "query_pre_attn_scalar": None if scalar == fields["head_dim"] else scalar,
            "attn_logit_softcapping": c["attn_logit_softcapping"],
            "final_logit_softcapping": c["final_logit_softcapping"]}
