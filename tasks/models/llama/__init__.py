"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2 with `qkv_bias`): the default family.

Its layers, shard rules, counts and Hugging Face tensor names are the shared rotary dense decoder's
(tasks/models/common/: the other rotary families build on them); hf.py: its config.json in and out.
"""

from __future__ import annotations

from tasks.families.llama import LLAMA
from tasks.models.common import blocks, sharding
from tasks.models.common import hf as common_hf
from tasks.models.family import ModelFamily
from tasks.models.llama import hf


class Llama(ModelFamily, spec=LLAMA, parts=(blocks, sharding, common_hf, hf)):
    """Pre-RMSNorm, rotary, GQA, SwiGLU; vocab-parallel embedding, head and cross entropy; optional tied head."""

    vocab_parallel = True


FAMILY = Llama()
