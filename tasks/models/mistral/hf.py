"""Mistral Hugging Face mapping: Llama's tensor names; config.json in and out with `sliding_window`."""

from __future__ import annotations

from typing import Any

from tasks.config.model import ModelConfig
from tasks.families.mistral import MISTRAL
from tasks.models.common import hf as common_hf

# transformers' MistralConfig default window is 4096 when the key is absent; null = full attention.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    MISTRAL.architectures[0]: ("mistral", {"max_position_embeddings": 131072, "sliding_window": 4096}),
}


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", max_position_embeddings: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """config.json of the exported model: MistralForCausalLM, its `sliding_window` written back (null = full)."""
    cfg = common_hf.base_hf_config(m, MISTRAL.architectures[0], "mistral", dtype=dtype,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id)
    cfg["sliding_window"] = m.sliding_window
    return cfg


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Mistral config.json, `sliding_window` included."""
    _, c, fields = common_hf.read_config(config, MISTRAL.name, ARCHITECTURES)
    common_hf.refuse(c, MISTRAL.name, {"attention_bias": bool(c["attention_bias"])})
    return {**fields, "sliding_window": c["sliding_window"]}
