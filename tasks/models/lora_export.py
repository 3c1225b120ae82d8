"""A LoRA run's artifacts: the PEFT adapter directory vLLM serves, and the base with the adapter merged in.

Why streamed from the checkpoint's layer files: the adapter is megabytes, but the layer files hold the frozen
base too; reading them one pipeline layer at a time (`CheckpointWeights`) and writing one tensor at a time
(`tasks.base.safetensors_stream`) keeps every process at one layer, at 70B as at 1B. The merged export is the
full export (tasks/models/export.py) with each layer's targeted weights replaced by W + (alpha / r) B A.

What vLLM needs of the adapter directory (vllm/lora/peft_helper.py, lora_model.py): `adapter_config.json`
with `r` (a rank it serves), `lora_alpha`, `target_modules`, `modules_to_save: null`, no DoRA; and
`adapter_model.safetensors` whose keys are PEFT's, each naming a target module:
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import atomic_write_json, fresh_dir
from tasks.base.model_files import DTYPES
from tasks.base.safetensors_stream import TensorEntry
from tasks.base.safetensors_stream import write as write_safetensors
from tasks.config.model import ModelConfig
from tasks.config.schema import LoraConfig
from tasks.models import get_family
from tasks.models.lora import adapter_full_shapes, is_adapter_param
from tasks.models.parallel import TPGroup
from tasks.models.weights import Weights

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_name(m: ModelConfig, name: str) -> str:
    """PEFT's key of an adapter tensor: `blocks.0.attn.q.lora_A.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    module, part, _ = name.rsplit(".", 2)
    return f"{PEFT_PREFIX}{get_family(m.family).hf_name(f'{module}.weight').removesuffix('.weight')}.{part}.weight"


class PeftAdapter:
    """A PEFT adapter directory read by our reference names (`Weights`' read: a full tensor or a piece)."""

    def __init__(self, directory: str | Path, m: ModelConfig) -> None:
        from safetensors import safe_open

        self.path, self.m = Path(directory) / ADAPTER_WEIGHTS, m
        if not self.path.is_file():
            raise InvalidInputError(f"{directory}: no {ADAPTER_WEIGHTS}")
        self.file = safe_open(self.path, "pt")
        self.keys = set(self.file.keys())

    def read(self, name: str, piece: tuple[int, int, int] | None = None) -> torch.Tensor:
        key = peft_name(self.m, name)
        if key not in self.keys:
            raise InvalidInputError(f"{self.path}: no tensor {key} (for {name}): another adapter shape")
        if piece is None:
            return self.file.get_tensor(key)
        dim, start, end = piece
        return self.file.get_slice(key)[(slice(None),) * dim + (slice(start, end),)]


def load_adapter(module: torch.nn.Module, weights: Weights | PeftAdapter, m: ModelConfig, tp: TPGroup) -> int:
    """Copy this rank's slice of every adapter tensor `module` holds (after `apply_lora`) from `weights` (a
    checkpoint, or a PEFT directory); returns the count."""
    from tasks.models.weights import local_named_params, read_slice

    count = 0
    with torch.no_grad():
        for name, param in local_named_params(module):
            if is_adapter_param(name):
                param.copy_(read_slice(weights, m, name, tp))  # type: ignore[arg-type]
                count += 1
    return count


def adapter_config(m: ModelConfig, lora: LoraConfig, base_model: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA (no DoRA, no rsLoRA, no modules to save)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules), "bias": "none", "modules_to_save": None,
        "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def write_adapter(m: ModelConfig, lora: LoraConfig, weights: Weights, dest: str | Path, *, base_model: str,
                  dtype: str = "bf16") -> Path:
    """The PEFT adapter directory of the adapters in `weights` at `dest` (absent or empty), atomically.
    `base_model`: what `base_model_name_or_path` names (the base version's artifact)."""
    torch_dtype = getattr(torch, DTYPES[dtype])
    names = sorted(adapter_full_shapes(m, lora).items(), key=lambda item: peft_name(m, item[0]))
    entries = [TensorEntry(peft_name(m, n), torch_dtype, shape) for n, shape in names]
    with fresh_dir(dest) as tmp:
        with open(tmp / ADAPTER_WEIGHTS, "wb") as sink:
            write_safetensors(sink, entries, ((peft_name(m, n), weights.read(n)) for n, _ in names),
                              {"format": "pt"})
        atomic_write_json(tmp / ADAPTER_CONFIG, adapter_config(m, lora, base_model))
    log.info("export: LoRA adapter (%d tensors, rank %d) -> %s", len(entries), lora.rank, dest)
    return Path(dest)


def export_lora(m: ModelConfig, lora: LoraConfig, kind: str, checkpoint_dir: str | Path, dest: str | Path, *,
                stages: int, dtype: str, base_dir: str | Path | None, base_model: str) -> Path:
    """A LoRA run's artifact directory (`publish.lora_export`): `adapter` the PEFT directory; `merged` the base
    with the adapter merged in (a normal model directory); `both` the merged directory with the PEFT one in
    its `adapter/` subdirectory. Each part is written once: a retry reuses what a previous attempt finished."""
    from tasks.models.export import export_checkpoint
    from tasks.models.weights import HF_INDEX, CheckpointWeights

    dest = Path(dest)
    if kind != "adapter" and not (dest / HF_INDEX).is_file():
        export_checkpoint(m, checkpoint_dir, dest, stages=stages, dtype=dtype, base_dir=base_dir, lora=lora)
    adapter_dir = dest if kind == "adapter" else dest / "adapter"
    if kind != "merged" and not (adapter_dir / ADAPTER_CONFIG).is_file():
        write_adapter(m, lora, CheckpointWeights(checkpoint_dir, m), adapter_dir, base_model=base_model, dtype=dtype)
    return dest
