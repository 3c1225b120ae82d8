"""Qwen3 Hugging Face config.json in and out (its tensor names, the QK-norm weights included, are the shared
decoder's)."""

from __future__ import annotations

from typing import Any

from tasks.config.model import ModelConfig
from tasks.families.qwen3 import QWEN3
from tasks.models.common import hf as common_hf

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    QWEN3.architectures[0]: ("qwen3", {"max_position_embeddings": 32768, "head_dim": 128, "sliding_window": None}),
}
def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: Qwen3ForCausalLM (QK-norm always on, no bias, full attention)."""
    cfg = common_hf.base_hf_config(m, QWEN3.architectures[0], "qwen3", dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    cfg.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    return cfg


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3 config.json; a QKV/o bias or `use_sliding_window: true` is refused."""
    _, c, fields = common_hf.read_config(config, QWEN3.name, ARCHITECTURES)
    common_hf.refuse(c, QWEN3.name, {"attention_bias": bool(c["attention_bias"]),
                                 "use_sliding_window": bool(c["use_sliding_window"])})
    return {**fields, "qk_norm": True}
