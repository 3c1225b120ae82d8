"""The file names and export dtypes of a model directory, in one place below every package that reads or writes one.

Why its own module: the registry (pulling a single-file version), the model readers and writers, the weights
fetch and deploy all name the same files; importing them from `tasks.models` would pull the model families
(and torch) into the registry and tie the registry above the models in the package graph.
"""

from __future__ import annotations

import json

from tasks.base.dataset_format import relative_key
from tasks.base.errors import InvalidInputError

LEGACY_FILE = "consolidated.pt"
HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
# What a Hugging Face model directory carries besides weights and config: copied from the model a run
# started from (its tokenizer is the published model's tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# Generation defaults (sampling settings, special token ids), kept whole from the model a run started from.
GENERATION_CONFIG = "generation_config.json"
# In a LoRA run's checkpoint (adapters and their optimizer states only): where its frozen base weights are,
# the run's starting weights (pinned by digest in the run identity); readers take the base tensors from there.
CHECKPOINT_BASE_FILE = "base_weights.json"
# Export dtypes as the config names them -> torch's attribute names.
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def index_shards(raw: bytes, where: str) -> list[str]:
    """The weight files a safetensors index (`HF_INDEX`) names, each once, sorted; each a plain relative name
    (no `..`, not absolute). InvalidInputError naming `where` for an index that is not one."""
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"{where}: unreadable safetensors index: {exc!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidInputError(f"{where}: weight_map must map each tensor name to a file name")
    files = sorted(set(weight_map.values()))
    for file in files:
        try:
            relative_key(file)
        except ValueError as exc:
            raise InvalidInputError(f"{where}: names {file!r}, a file outside its folder ({exc}); refused") from None
    return files
