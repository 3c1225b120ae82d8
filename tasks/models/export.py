"""Export a committed checkpoint as a Hugging Face model directory: the artifact a version publishes.

Why stage by stage: a 70B model must never pass through one process whole. Each pipeline stage's
layers are read from the checkpoint's per-layer, per-TP-rank files, joined across TP ranks one
tensor at a time, and written to that stage's own safetensors files by its own process (the last stage
by the parent, which then writes the index, config.json, generation_config.json and the tokenizer files
the model came with). The result loads with `AutoModelForCausalLM.from_pretrained` (llama family) or our evaluate
(both families), and serves with vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tasks.base.fsutil import atomic_write_json, fresh_dir
from tasks.base.model_files import DTYPES, GENERATION_CONFIG, HF_CONFIG, HF_INDEX, TOKENIZER_FILES
from tasks.config.model import ModelConfig
from tasks.config.schema import LoraConfig
from tasks.models import get_family
from tasks.models.shapes import pipeline_stages
from tasks.models.weights import CheckpointWeights

log = logging.getLogger(__name__)


FILES_PER_STAGE = 4
"""Safetensors files each pipeline stage's weights are written to: runs of its tensors (sorted by name) of about
equal bytes. Why not one: a file's sha256 is one core's work (1.1-2 GB/s), where a node's disk takes 2-7 GB/s;
four files are hashed on four cores at once (four TP ranks' or four threads of one rank). A 70B model on pp=8
gets 32 files of ~4.4 GB, as published Llama checkpoints come (30 of ~5 GB). A stage holds at least one block,
so at least four tensors in every family."""


def shard_name(stage: int, part: int, stages: int) -> str:
    """File `part` of pipeline stage `stage`'s weights, numbered across the model as Hugging Face numbers shards."""
    return f"model-{stage * FILES_PER_STAGE + part + 1:05d}-of-{stages * FILES_PER_STAGE:05d}.safetensors"


def split_stage(nbytes: Sequence[int], parts: int = FILES_PER_STAGE) -> list[range]:
    """The tensors (by position) of each of a stage's `parts` files: contiguous runs of about equal bytes, none
    empty; a function of the sizes alone, so every export of the same weights cuts them alike."""
    if len(nbytes) < parts:
        raise ValueError(f"a stage of {len(nbytes)} tensors cannot fill {parts} files")
    prefix = list(itertools.accumulate(nbytes, initial=0))
    cuts = [0]
    for k in range(1, parts):
        low, high = cuts[-1] + 1, len(nbytes) - (parts - k)  # leave each later file one tensor at least
        target = k * prefix[-1]  # times `parts`: integers only
        cuts.append(min(range(low, high + 1), key=lambda i: (abs(prefix[i] * parts - target), i)))
    cuts.append(len(nbytes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def stage_layers(m: ModelConfig, stages: int) -> list[list[int]]:
    """PipelineModule layer indices of each stage, as the training placed them (the planner's placement)."""
    out, first = [], 0
    for st in pipeline_stages(m.n_layers, stages):
        count = int(st.has_embedding) + st.blocks + int(st.has_head)
        out.append(list(range(first, first + count)))
        first += count
    return out


def write_stage(checkpoint_dir: str, model: dict[str, Any], layers: list[int], stage: int, stages: int,
                dest_dir: str, dtype: str, lora: dict[str, Any] | None = None) -> dict[str, tuple[str, int]]:
    """One stage's tensors, TP-joined and renamed to Hugging Face names, into its `FILES_PER_STAGE` safetensors
    files in `dest_dir`. Returns {HF name: (file, bytes)}. Its memory is one stage (a process of its own for
    each stage but the last).
    `lora`: the run's train.lora: its adapters are merged into their weights (tasks/models/lora_export.py)."""
    import torch
    from safetensors.torch import save_file

    from tasks.models.lora import merge_layer

    m = ModelConfig.model_validate(model)
    family, weights = get_family(m.family), CheckpointWeights(checkpoint_dir, m)
    adapter = None if lora is None else LoraConfig.model_validate(lora)
    torch_dtype = getattr(torch, DTYPES[dtype])
    tensors = {}
    for index in layers:
        layer = weights.layer(index)
        for name, tensor in (layer if adapter is None else merge_layer(adapter, layer)).items():
            for hf, piece in family.hf_tensors(name, tensor):
                tensors[hf] = piece.to(torch_dtype).contiguous()
    names = sorted(tensors)  # as the ranks' export orders them (tasks/train/export.py): the same bytes
    sizes = [tensors[name].nbytes for name in names]
    written = {}
    for part, run in enumerate(split_stage(sizes)):
        file = shard_name(stage, part, stages)
        save_file({names[i]: tensors[names[i]] for i in run}, os.path.join(dest_dir, file), metadata={"format": "pt"})
        written.update({names[i]: (file, sizes[i]) for i in run})
    return written


def export_checkpoint(m: ModelConfig, checkpoint_dir: str | Path, dest: str | Path, *, stages: int,
                      dtype: str = "bf16", base_dir: str | Path | None = None, lora: LoraConfig | None = None) -> Path:
    """Write the checkpoint's weights as a Hugging Face directory at `dest` (absent or empty), atomically
    (`lora`: a LoRA run's, with its adapters merged in).

    `stages`: the training pipeline stages, written in parallel (each to `FILES_PER_STAGE` files). `base_dir`:
    the Hugging Face directory the run started from (pretrained or a published version), whose tokenizer
    files and config.json (in its own format, with what training changed) the export keeps."""
    groups = [g for g in stage_layers(m, stages) if g]
    *others, last = groups
    with fresh_dir(dest) as tmp:
        args = (str(checkpoint_dir), m.model_dump(mode="json"))
        tail = (len(groups), str(tmp), dtype, None if lora is None else lora.model_dump(mode="json"))
        ctx = multiprocessing.get_context("spawn")  # no inherited torch threads or locks
        # The last stage in this process meanwhile (a stage's memory, as each worker's): one process fewer to
        # start (an interpreter and torch's import, seconds of CPU), none for a single stage.
        workers = max(1, min(len(others), (os.cpu_count() or 1) - 1))
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) if others else contextlib.nullcontext() as pool:
            futures = [pool.submit(write_stage, *args, layers, i, *tail) for i, layers in enumerate(others)]
            last_map = write_stage(*args, last, len(others), *tail)
            stage_maps = [fut.result() for fut in futures] + [last_map]
        weight_map, total = {}, 0
        for stage_map in stage_maps:
            for name, (file, size) in stage_map.items():
                weight_map[name] = file
                total += size
        write_metadata(tmp, m, weight_map, total, dtype=dtype, base_dir=base_dir)
    log.info("export: %s -> %s (%d shards, %d bytes of %s weights)", checkpoint_dir, dest,
             len(set(weight_map.values())), total, dtype)
    return Path(dest)


def write_metadata(dest: Path, m: ModelConfig, weight_map: dict[str, str], total_bytes: int, *, dtype: str,
                   base_dir: str | Path | None) -> list[str]:
    """Everything of the directory but the shards: the index, config.json, generation_config.json and the
    tokenizer files of `base_dir` (the model the run started from, whose config.json the export keeps in its
    own format: `ModelFamily.export_config`). Returns the names written."""
    family = get_family(m.family)
    base_config = _read_json(Path(base_dir) / HF_CONFIG) if base_dir else {}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_json(dest / HF_INDEX, index)
    config = family.export_config(m, base_config, dtype=DTYPES[dtype])
    atomic_write_json(dest / HF_CONFIG, config)
    atomic_write_json(dest / GENERATION_CONFIG, generation_config(config, base_dir))
    written = [HF_INDEX, HF_CONFIG, GENERATION_CONFIG]
    for name in TOKENIZER_FILES:
        if base_dir and (Path(base_dir) / name).is_file():
            shutil.copyfile(Path(base_dir) / name, dest / name)
            written.append(name)
    return written


def generation_config(config: dict[str, Any], base_dir: str | Path | None) -> dict[str, Any]:
    """generation_config.json of the export: the parent's as it was (temperature, top_p, max_new_tokens, ...:
    a retrain changes the weights, not how the model is meant to be sampled), with the special token ids of
    `config` where the parent's file has none; without a parent file, those ids alone."""
    generation = _read_json(Path(base_dir) / GENERATION_CONFIG) if base_dir else {}
    for key in ("bos_token_id", "eos_token_id"):
        if generation.get(key) is None and config.get(key) is not None:
            generation[key] = config[key]
    return generation


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
