"""The export phase of a training job: the ranks of each pipeline stage write that stage's shard of the
Hugging Face export straight into the artifact store's staging area.

Why here and not on the Airflow worker: at 70B the export is 140 GB; reading the checkpoint on the
Airflow worker would copy the whole model through one machine. After the last checkpoint the ranks
hold the final weights already, sharded: in each stage the data-parallel rank-0 tensor-parallel
group gathers each tensor's TP slices onto its TP rank 0 (one tensor at a time), which writes the
stage's shard (`model-0000s-of-0000n.safetensors`, one stage's tensors in host memory) and uploads
it into the staging area, hashing while it streams (`ArtifactStore.stage_file`). It reports the file
(path, size, sha256) and its tensors (gathered into rank 0's summary, and kept in
`<run dir>/export/<tag>/shard-<stage>.json` so a retry on the same disks reuses them); publish adds the
small files (index, config.json, tokenizer) and commits the tree: the Airflow worker never touches a
weight. Credentials for the store reach the ranks as AWS_* environment variables, never in a file.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tasks.config import ModelConfig
from tasks.fsutil import atomic_write_json
from tasks.models import get_family
from tasks.models.export import DTYPES, shard_name
from tasks.models.parallel import TPGroup
from tasks.models.weights import local_named_params
from tasks.run import EXPORT_DIR

log = logging.getLogger(__name__)


def reports_dir(output_dir: str | Path, tag: str) -> Path:
    return Path(output_dir) / EXPORT_DIR / tag


def read_reports(output_dir: str | Path, tag: str, stages: int) -> list[dict[str, Any]] | None:
    """Every stage's shard report of checkpoint `tag`, or None while one is missing."""
    found = sorted(reports_dir(output_dir, tag).glob("shard-*.json"))
    if len(found) != stages:
        return None
    return [json.loads(p.read_text()) for p in found]


def export_stage(module: torch.nn.Module, m: ModelConfig, tp: TPGroup, *, stage: int, stages: int, dp_rank: int,
                 spec: dict[str, Any], output_dir: str | Path, tag: str) -> dict[str, Any] | None:
    """This rank's part of the export (collective within its TP group; data-parallel ranks > 0 have none);
    the stage's report on the rank that wrote the shard, else None."""
    if dp_rank != 0:
        return None
    from safetensors.torch import save_file

    from tasks.registry import ArtifactStore

    family, dtype = get_family(m.family), getattr(torch, DTYPES[spec["dtype"]])
    tensors: dict[str, torch.Tensor] = {}
    for name, param in local_named_params(module):
        if stage > 0 and name.startswith("embed."):
            continue  # the last stage's tied copy of the embedding: stage 0 exports it
        local = param.detach().contiguous()
        if tp.size > 1 and family.shard_spec(m, name, tp.rank, tp.size) is not None:
            pieces = [torch.empty_like(local) for _ in range(tp.size)]
            tdist.all_gather(pieces, local, group=tp.group)
            if tp.rank == 0:
                tensors[family.hf_name(name)] = family.unshard(m, name, pieces).to(dtype).cpu().contiguous()
        elif tp.rank == 0:
            tensors[family.hf_name(name)] = local.to(dtype).cpu().contiguous()
    if tp.rank != 0:
        return None
    file = shard_name(stage, stages)
    store = ArtifactStore(spec["store_url"], spec["storage_options"])
    with tempfile.TemporaryDirectory(prefix="retrainer-export-") as tmp:
        save_file(tensors, str(Path(tmp) / file), metadata={"format": "pt"})
        staged = store.stage_file(spec["staging"], file, Path(tmp) / file)
    report = {"stage": stage, "file": staged.to_dict(), "staging": spec["staging"],
              "weights": {n: t.numel() * t.element_size() for n, t in tensors.items()}}
    atomic_write_json(reports_dir(output_dir, tag) / f"shard-{stage:05d}.json", report)
    log.info("export: stage %d/%d wrote %s (%d tensors, %.1f MB) into the store's staging area",
             stage + 1, stages, file, len(tensors), staged.size / 1e6)
    return report
