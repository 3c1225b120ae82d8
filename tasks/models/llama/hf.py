"""Llama-family Hugging Face config.json in and out: LlamaForCausalLM, or Qwen2ForCausalLM with `qkv_bias`
(the tensor names are the shared decoder's, tasks/models/common/hf.py)."""

from __future__ import annotations

from typing import Any

from tasks.config.model import ModelConfig
from tasks.families.llama import LLAMA
from tasks.models.common.hf import base_hf_config, read_config, refuse

_LLAMA, _QWEN2 = LLAMA.architectures
# Architectures we read, with the HF defaults of the keys a config.json may leave out.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    _LLAMA: ("llama", {"max_position_embeddings": 2048}),
    _QWEN2: ("qwen2", {"max_position_embeddings": 32768}),
}


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: LlamaForCausalLM, or Qwen2ForCausalLM when `qkv_bias`.

    Why Qwen2 for qkv_bias: Llama's `attention_bias` also puts a bias on o_proj,
    which this model does not have.
    """
    qwen = m.qkv_bias
    cfg = base_hf_config(m, _QWEN2 if qwen else _LLAMA, "qwen2" if qwen else "llama",
                         dtype=dtype, max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id)
    if qwen:
        cfg["use_sliding_window"] = False
    else:
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields implied by a Hugging Face config.json; unsupported features fail naming the key."""
    model_type, c, fields = read_config(config, LLAMA.name, ARCHITECTURES)
    refuse(c, LLAMA.name, {
        "attention_bias": model_type != "qwen2" and bool(c["attention_bias"]),  # Llama's puts a bias on o_proj too
        "use_sliding_window": model_type == "qwen2" and bool(c["use_sliding_window"]),
    })
    return {**fields, "qkv_bias": model_type == "qwen2"}
