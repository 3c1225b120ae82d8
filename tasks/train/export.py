"""The export phase of a training job: the ranks of each pipeline stage write that stage's files of the
Hugging Face export straight into the artifact store's staging area.

Why here and not on the Airflow worker: at 70B the export is 140 GB; reading the checkpoint on the
Airflow worker would copy the whole model through one machine. After the last checkpoint the ranks
hold the final weights already, sharded. A stage's tensors go to `FILES_PER_STAGE` files
(`model-0000k-of-0000n.safetensors`, tasks/models/export.py), spread over the data-parallel rank-0
tensor-parallel group: file k is written by TP rank k mod tp, which gathers each of its tensors' TP slices
(one tensor at a time) and streams the file straight into the staging area: the header first (the shapes
are known before any byte), then tensor by tensor, hashed while written, written once
(`ArtifactStore.stage_stream`, `tasks.base.safetensors_stream`), converted to the export dtype piece by piece.
A rank writing several files writes them at once, a thread each: a sha256 is one core's work, the disk is
faster. Host memory holds the stage's own weights and a few pieces and gathered tensors more, never a
second copy. It imports `tasks.registry.store`, never the registry's database layer (sqlalchemy). Each file
is reported (path, size, sha256, its tensors), gathered into rank 0's summary and kept in
`<run dir>/export/<tag>/shard-<file>.json` so a retry on the same disks reuses them; publish adds the
small files (index, config.json, tokenizer) and commits the tree: the Airflow worker never touches a
weight. Credentials for the store reach the ranks as AWS_* environment variables, never in a file.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from tasks.base.fsutil import atomic_write_json
from tasks.base.model_files import DTYPES
from tasks.base.safetensors_stream import PIECE, TensorEntry
from tasks.base.safetensors_stream import write as write_safetensors
from tasks.config.model import ModelConfig
from tasks.models import get_family
from tasks.models.common.moe_sharding import expert_range
from tasks.models.export import FILES_PER_STAGE, shard_name, split_stage
from tasks.models.parallel import TPGroup
from tasks.models.weights import local_named_params
from tasks.runs.identity import EXPORT_DIR

if TYPE_CHECKING:
    from tasks.registry.tree import TreeFile

log = logging.getLogger(__name__)


def reports_dir(output_dir: str | Path, tag: str) -> Path:
    return Path(output_dir) / EXPORT_DIR / tag


def read_reports(output_dir: str | Path, tag: str) -> list[dict[str, Any]]:
    """The file reports of checkpoint `tag`'s export found in this node's run dir (each node keeps its own)."""
    return [json.loads(p.read_text()) for p in sorted(reports_dir(output_dir, tag).glob("shard-*.json"))]


class _FileWriters:
    """This rank's files of the stage, each written by its own thread from a queue of tensors (hashing is one
    core per file). A queued tensor is either a view of a parameter (free) or of one gathered across the TP group
    (a whole tensor's memory): at most `OWNED_IN_FLIGHT` of those wait, so memory stays a stage plus a few
    tensors. A failure anywhere ends the streams still open (their partial files removed by `stage_stream`) and
    is raised; files already whole stay unreported, so a retry writes them again and housekeeping removes a
    staging area no version took."""

    OWNED_IN_FLIGHT = 2
    _END = object()

    def __init__(self, store: Any, staging: str, files: dict[int, tuple[str, list[TensorEntry]]]) -> None:
        self._owned = threading.BoundedSemaphore(self.OWNED_IN_FLIGHT)
        self._queues: dict[int, queue.SimpleQueue[Any]] = {part: queue.SimpleQueue() for part in files}
        piece = max(1 << 20, PIECE // max(1, len(files)))  # two pieces per file: 2 * PIECE in all, as one file
        self._pool = ThreadPoolExecutor(max(1, len(files)), thread_name_prefix="export-file")
        self._futures = {
            part: self._pool.submit(store.stage_stream, staging, file,
                                    functools.partial(self._write, entries, self._queues[part], piece))
            for part, (file, entries) in files.items()}

    def _write(self, entries: list[TensorEntry], q: queue.SimpleQueue[Any], piece: int, sink: Any) -> None:
        write_safetensors(sink, entries, self._drain(q), {"format": "pt"}, piece)

    def _drain(self, q: queue.SimpleQueue[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := q.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            name, tensor, owned = item
            yield name, tensor
            if owned:
                self._owned.release()

    def put(self, part: int, name: str, tensor: torch.Tensor, *, owned: bool) -> None:
        if owned:
            while not self._owned.acquire(timeout=0.1):
                self._raise_failed()
        self._queues[part].put((name, tensor, owned))

    def _raise_failed(self) -> None:
        for future in self._futures.values():
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def finish(self) -> dict[int, TreeFile]:
        for q in self._queues.values():
            q.put(self._END)
        try:
            return {part: future.result() for part, future in self._futures.items()}
        finally:
            self._pool.shutdown()

    def abort(self, exc: BaseException) -> None:
        for q in self._queues.values():
            q.put(exc)
        self._pool.shutdown()


def _sharded(m: ModelConfig, name: str, tp: TPGroup) -> bool:
    return tp.size > 1 and get_family(m.family).shard_spec(m, name, tp.layout, tp.coord) is not None


def _pieces(params: dict[str, torch.Tensor], m: ModelConfig, tp: TPGroup) -> list[tuple[str, str, int,
                                                                                        tuple[int, ...]]]:
    """Each parameter's exported tensors (one, or a stacked expert tensor's per-expert parts: `hf_tensors`) as
    (Hugging Face name, parameter, its place in the parameter's hf_tensors, shape), sorted by Hugging Face name,
    as `safetensors.torch.save_file` lays out tensors of one dtype: the same weights give the same bytes (and
    tree digest) whichever export wrote them. The joined shapes (every TP rank's slice, every expert-parallel
    rank's experts) come from shapes alone: meta tensors hold no memory."""
    family = get_family(m.family)
    pieces = []
    for name, param in params.items():
        full = torch.empty_like(param, device="meta")
        if _sharded(m, name, tp):
            full = family.unshard(m, name, [full] * tp.size)
        if expert_range(m, name, tp.layout, tp.coord) is not None:
            full = full.repeat(tp.layout.ep, *([1] * (full.dim() - 1)))
        pieces += [(hf, name, k, tuple(t.shape)) for k, (hf, t) in enumerate(family.hf_tensors(name, full))]
    return sorted(pieces)


def _tp_joined(m: ModelConfig, name: str, local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The whole of a TP-sharded tensor on every rank of the TP group (collective)."""
    gathered = [torch.empty_like(local) for _ in range(tp.size)]
    tdist.all_gather(gathered, local, group=tp.group)
    return get_family(m.family).unshard(m, name, gathered)


def _expert_joined(local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """A layer's experts of every expert-parallel rank, in expert order, gathered on expert-parallel rank 0
    (collective over the expert-parallel group; `_send_experts` is the other ranks' side)."""
    gathered = [torch.empty_like(local) for _ in range(tp.layout.ep)]
    tdist.gather(local, gathered, group_dst=0, group=tp.ep_group)
    return torch.cat(gathered)


def _send_experts(module: torch.nn.Module, m: ModelConfig, tp: TPGroup) -> None:
    """An expert-parallel rank > 0's part of the export: its experts of each layer, TP-joined within its own TP
    group, handed to rank 0's writer in the order the writer reaches them (`_pieces`)."""
    experts = {name: p for name, p in local_named_params(module) if expert_range(m, name, tp.layout, tp.coord)}
    for name in dict.fromkeys(name for _, name, _, _ in _pieces(experts, m, tp)):
        local = experts[name].detach().contiguous()
        if _sharded(m, name, tp):
            local = _tp_joined(m, name, local, tp)
        tdist.gather(local, None, group_dst=0, group=tp.ep_group)


def export_stage(module: torch.nn.Module, m: ModelConfig, tp: TPGroup, *, spec: dict[str, Any],
                 output_dir: str | Path, tag: str) -> list[dict[str, Any]]:
    """This rank's part of the export (collective within its TP group; data-parallel ranks > 0 have none, but
    under expert parallelism ranks 1 .. ep-1 hand their experts to rank 0's): the reports of the files it wrote,
    none where it wrote none. `tp` says where the rank sits (its stage, replica)."""
    if tp.coord.dp >= tp.layout.ep:
        return []
    if tp.coord.dp != 0:
        _send_experts(module, m, tp)
        return []
    stage, stages = tp.coord.pp, tp.layout.pp
    family, dtype = get_family(m.family), getattr(torch, DTYPES[spec["dtype"]])
    # The last stage's tied copy of the embedding is left out: stage 0 exports it.
    params = {name: param for name, param in local_named_params(module)
              if stage == 0 or not name.startswith("embed.")}

    pieces = _pieces(params, m, tp)
    entries = [TensorEntry(hf, dtype, shape) for hf, _, _, shape in pieces]
    last = {name: i for i, (_, name, _, _) in enumerate(pieces)}  # where each parameter's last piece goes
    runs = split_stage([e.nbytes for e in entries])
    part_of = [part for part, run in enumerate(runs) for _ in run]
    mine = {part: (shard_name(stage, part, stages), [entries[i] for i in run])
            for part, run in enumerate(runs) if part % tp.size == tp.rank}  # files spread over the TP group
    from tasks.registry.store import ArtifactStore  # not `tasks.registry`: a rank never loads the database layer

    writers = _FileWriters(ArtifactStore(spec["store_url"], spec["storage_options"]), spec["staging"], mine)
    try:
        joined: dict[str, tuple[list[torch.Tensor], bool]] = {}  # a parameter's pieces until its last is queued
        for i, (_, name, k, _) in enumerate(pieces):
            if name not in joined:
                local, owned = params[name].detach().contiguous(), False
                if _sharded(m, name, tp):  # joined on the TP rank that writes it (every rank gathers: collective)
                    local, owned = _tp_joined(m, name, local, tp), True
                if expert_range(m, name, tp.layout, tp.coord) is not None:
                    local, owned = _expert_joined(local, tp), True
                joined[name] = ([t for _, t in family.hf_tensors(name, local)], owned)
                del local
            tensors, owned = joined[name]
            if part_of[i] in mine:  # written in `dtype`, piece by piece (safetensors_stream)
                writers.put(part_of[i], entries[i].name, tensors[k].contiguous(), owned=owned)
            if last[name] == i:
                del joined[name]
        staged = writers.finish()
    except BaseException as exc:
        writers.abort(exc)
        raise
    reports = []
    for part, file in staged.items():
        report = {"stage": stage, "file": file.to_dict(), "staging": spec["staging"],
                  "weights": {e.name: e.nbytes for e in mine[part][1]}}
        atomic_write_json(reports_dir(output_dir, tag) / f"shard-{stage * FILES_PER_STAGE + part:05d}.json", report)
        reports.append(report)
    log.info("export: stage %d/%d wrote %s (%.1f MB) into the store's staging area", stage + 1, stages,
             ", ".join(f.path for f in staged.values()) or "none of its files here",
             sum(f.size for f in staged.values()) / 1e6)
    return reports
