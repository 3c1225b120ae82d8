"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2 with `qkv_bias`): the default family.

model.py: the layers; sharding.py: shapes, shard rules and counts; hf.py: Hugging Face names and config.json.
"""

from __future__ import annotations

from typing import ClassVar

from tasks.models.family import ModelFamily
from tasks.models.llama import hf, model, sharding


class Llama(ModelFamily):
    """Pre-RMSNorm, rotary, GQA, SwiGLU; vocab-parallel embedding, head and cross entropy; optional tied head."""

    name = "llama"
    architectures: ClassVar[tuple[str, ...]] = tuple(hf.ARCHITECTURES)
    vocab_parallel = True
    Embedding, TransformerBlock, Head, Reference = model.Embedding, model.TransformerBlock, model.Head, model.Reference

    pipeline_layers = staticmethod(model.pipeline_layers)
    make_loss_fn = staticmethod(model.make_loss_fn)
    make_token_nll_fn = staticmethod(model.make_token_nll_fn)
    full_shapes = staticmethod(sharding.full_shapes)
    shard_spec = staticmethod(sharding.shard_spec)
    unshard = staticmethod(sharding.unshard)
    param_counts = staticmethod(sharding.param_counts)
    hf_name = staticmethod(hf.hf_name)
    ref_name = staticmethod(hf.ref_name)
    hf_config = staticmethod(hf.hf_config)
    model_fields_from_hf = staticmethod(hf.model_fields_from_hf)
    hf_rope_parameters = staticmethod(hf.rope_parameters)


FAMILY = Llama()
