"""The export phase of a training job: the ranks of each pipeline stage write that stage's shard of the
Hugging Face export straight into the artifact store's staging area.

Why here and not on the Airflow worker: at 70B the export is 140 GB; reading the checkpoint on the
Airflow worker would copy the whole model through one machine. After the last checkpoint the ranks
hold the final weights already, sharded: in each stage the data-parallel rank-0 tensor-parallel
group gathers each tensor's TP slices onto its TP rank 0 (one tensor at a time), which streams the
stage's shard (`model-0000s-of-0000n.safetensors`) straight into the staging area: the header first
(the shapes are known before any byte), then tensor by tensor, hashed while written, written once
(`ArtifactStore.stage_stream`, `tasks.safetensors_stream`), converted to the export dtype piece by
piece: host memory holds the stage's own weights and a few pieces more, never a second copy.
It imports `tasks.registry.store`, never the registry's database layer (sqlalchemy). It reports the file
(path, size, sha256) and its tensors (gathered into rank 0's summary, and kept in
`<run dir>/export/<tag>/shard-<stage>.json` so a retry on the same disks reuses them); publish adds the
small files (index, config.json, tokenizer) and commits the tree: the Airflow worker never touches a
weight. Credentials for the store reach the ranks as AWS_* environment variables, never in a file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tasks.config import ModelConfig
from tasks.fsutil import atomic_write_json
from tasks.model_files import DTYPES
from tasks.models import get_family
from tasks.models.export import shard_name
from tasks.models.parallel import TPGroup
from tasks.models.weights import local_named_params
from tasks.run import EXPORT_DIR
from tasks.safetensors_stream import TensorEntry
from tasks.safetensors_stream import write as write_safetensors

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
    family, dtype = get_family(m.family), getattr(torch, DTYPES[spec["dtype"]])
    # Sorted by Hugging Face name, as `safetensors.torch.save_file` lays out tensors of one dtype: the same
    # weights give the same bytes (and tree digest) whichever export wrote them. The last stage's tied copy
    # of the embedding is left out: stage 0 exports it.
    params = sorted(((name, param) for name, param in local_named_params(module)
                     if stage == 0 or not name.startswith("embed.")), key=lambda np: family.hf_name(np[0]))

    def sharded(name: str) -> bool:
        return tp.size > 1 and family.shard_spec(m, name, tp.rank, tp.size) is not None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        """Each full tensor on TP rank 0, one at a time, as the rank holds it (every TP rank walks it: the
        gathers are collective)."""
        for name, param in params:
            local = param.detach().contiguous()
            if sharded(name):
                pieces = [torch.empty_like(local) for _ in range(tp.size)]
                tdist.all_gather(pieces, local, group=tp.group)
                local = family.unshard(m, name, pieces)
                del pieces
            if tp.rank == 0:
                yield family.hf_name(name), local  # written in `dtype`, piece by piece (safetensors_stream)

    if tp.rank != 0:
        for _ in tensors():
            pass
        return None
    from tasks.registry.store import ArtifactStore  # not `tasks.registry`: a rank never loads the database layer

    entries = []
    for name, param in params:
        shape = param.shape
        if sharded(name):  # the joined shape, from shapes alone (meta tensors hold no memory)
            shape = family.unshard(m, name, [torch.empty_like(param, device="meta")] * tp.size).shape
        entries.append(TensorEntry(family.hf_name(name), dtype, tuple(shape)))
    file = shard_name(stage, stages)
    store = ArtifactStore(spec["store_url"], spec["storage_options"])
    staged = store.stage_stream(spec["staging"], file,
                                lambda sink: write_safetensors(sink, entries, tensors(), {"format": "pt"}))
    report = {"stage": stage, "file": staged.to_dict(), "staging": spec["staging"],
              "weights": {e.name: e.nbytes for e in entries}}
    atomic_write_json(reports_dir(output_dir, tag) / f"shard-{stage:05d}.json", report)
    log.info("export: stage %d/%d wrote %s (%d tensors, %.1f MB) into the store's staging area",
             stage + 1, stages, file, len(entries), staged.size / 1e6)
    return report
