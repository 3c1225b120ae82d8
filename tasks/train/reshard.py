"""What one rank reads from a checkpoint, and its ZeRO optimizer partition cut anew when the run resumes at
another data-parallel size.

Why: DeepSpeed refuses a ZeRO checkpoint written at another dp, and its elastic path merges every partition
on every rank (a whole stage's optimizer in each rank's memory: at 70B, far more than a rank holds). A
ZeRO-1/2 parameter group is one flat vector laid out alike at any dp (the parameters in order, padding only
at the end); rank k of dp owns [k x P, (k + 1) x P), P its padded share. So a new rank copies, from just the
old partition files whose ranges overlap its own, just those elements: the fp32 master weights and every
per-element optimizer state (Adam's moments). Under expert parallelism an expert group is cut the same way
over the dp / ep ranks holding the same experts (DeepSpeed's expert-data-parallel group). Files are
memory-mapped (torch.load(mmap=True)): only the pages it copies are read. Weights (`layer_*`) and the engine's
counters and LR schedule do not depend on dp: DeepSpeed loads them as usual.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    GROUP_PADDINGS,
    OPTIMIZER_STATE_DICT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)

from tasks.base.errors import InvalidInputError
from tasks.base.layout import Layout
from tasks.base.model_files import CHECKPOINT_BASE_FILE
from tasks.train import checkpoint as ck


def partition_numel(group_numel: int, dp: int, alignment: int) -> int:
    """Each rank's share of a flat group of `group_numel` elements at `dp` ranks (DeepSpeed pads the group to
    a multiple of alignment x dp)."""
    return math.ceil(group_numel / (alignment * dp)) * alignment


def overlapping(start: int, stop: int, part: int) -> range:
    """The old ranks whose shares [k x part, (k + 1) x part) meet [start, stop)."""
    return range(start // part, -(-stop // part)) if stop > start else range(0)


def _groups(engine: Any) -> list[tuple[int, int, int, bool]]:
    """Per parameter group of this rank's ZeRO optimizer: (flat numel without the end padding, this rank's
    share, its start in the flat group, whether it is an expert group: partitioned over the ranks holding the
    same experts, not over dp)."""
    opt = engine.optimizer
    experts = getattr(opt, "is_moe_param_group", None) or [False] * len(opt.single_partition_of_fp32_groups)
    out = []
    for i, part in enumerate(opt.single_partition_of_fp32_groups):
        numel = sum(m.numel() for m in opt.round_robin_bit16_meta[i]) + sum(opt.round_robin_bit16_padding[i])
        out.append((numel, part.numel(), tdist.get_rank(group=opt.real_dp_process_group[i]) * part.numel(),
                    bool(experts[i])))
    return out


def _old_shares(engine: Any, old_dp: int, ep: int) -> list[tuple[int, int, int, int, list[int]]]:
    """Per group: (flat numel, this rank's share, its start, the old partition size, the old data-parallel rank
    of each old partition). An expert group's partitions were cut over the old ranks holding this rank's
    experts (its expert-data-parallel group at the old dp: `Layout.expert_replicas`)."""
    align = engine.optimizer.nccl_start_alignment_factor
    new, old = Layout(dp=engine.dp_world_size, ep=ep), Layout(dp=old_dp, ep=ep)
    replicas = old.expert_replicas(new.ep_index(tdist.get_rank(group=engine.optimizer.dp_process_group)))
    out = []
    for numel, share, start, expert in _groups(engine):
        owners = replicas if expert else list(range(old_dp))
        out.append((numel, share, start, partition_numel(numel, len(owners), align), owners))
    return out


def old_zero_ranks(engine: Any, old_dp: int, ep: int = 1) -> list[int]:
    """The old data-parallel ranks whose ZeRO partition files this rank reads at the new dp."""
    ranks: set[int] = set()
    for numel, share, start, part_old, owners in _old_shares(engine, old_dp, ep):
        ranks.update(owners[k] for k in overlapping(start, min(start + share, numel), part_old))
    return sorted(ranks)


def _zero_file(engine: Any, ckpt_root: Path, tag: str, dp_rank: int) -> Path:
    return Path(engine._get_rank_zero_ckpt_name(str(ckpt_root), tag, engine.checkpoint_mp_rank, dp_rank,
                                                engine.bfloat16_enabled()))


def rank_files(engine: Any, ckpt_root: Path, tag: str, available: list[str], old_dp: int, rank: int,
               ep: int = 1) -> list[str]:
    """The names (of `available`, the tag's files) this rank loads on resume: its stage's layer files and the
    engine's model-state files (DeepSpeed lists them by pattern and picks its own), its ZeRO partition
    file(s) (at another dp: the old ones overlapping its new share) and its per-rank state (at another dp
    only rank 0 reads one: the losses so far); with them, an adapter-only checkpoint's note of where its
    base is, so the checkpoint reads whole there too."""
    module, resharded = engine.module, old_dp != engine.dp_world_size
    layers = tuple(f"layer_{i + module._local_start:02d}-" for i, f in enumerate(module.forward_funcs)
                   if hasattr(f, "load_state_dict"))
    wanted = {n for n in available if n.startswith(layers) or (n.startswith("mp_rank_") and n.endswith(
        "_model_states.pt")) or n == CHECKPOINT_BASE_FILE}
    if engine.zero_optimization():
        own = tdist.get_rank(group=engine.optimizer.dp_process_group)
        dp_ranks = old_zero_ranks(engine, old_dp, ep) if resharded else [own]
        wanted.update(_zero_file(engine, ckpt_root, tag, k).name for k in dp_ranks)
    if not resharded or rank == 0:
        wanted.add(ck.rank_file(Path(), rank).name)
    return sorted(wanted & set(available))


def load_zero_partitions(engine: Any, ckpt_root: Path, tag: str, old_dp: int, ep: int = 1) -> int:
    """Fill this rank's ZeRO-1/2 partition (fp32 master weights and optimizer state) from a checkpoint written
    at `old_dp` ranks (and the same `ep`); how many old partition files it read. Call after
    `engine.load_checkpoint(..., load_optimizer_states=False)` (weights, counters, LR schedule)."""
    opt = engine.optimizer
    files: dict[int, dict[str, Any]] = {}

    def old(k: int) -> dict[str, Any]:
        if k not in files:
            path = _zero_file(engine, ckpt_root, tag, k)
            if not path.is_file():
                raise InvalidInputError(f"{path}: missing ZeRO partition of data-parallel rank {k} of {old_dp}")
            sd = torch.load(path, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT]
            if not isinstance(sd[BASE_OPTIMIZER_STATE], dict):
                raise InvalidInputError(f"{path}: an elastic ZeRO checkpoint; resharding reads the rigid layout")
            files[k] = {"sd": sd, "path": path}
        return files[k]

    state: dict[int, dict[str, Any]] = {}
    param_groups = None
    for i, (numel, share, start, part_old, owners) in enumerate(_old_shares(engine, old_dp, ep)):
        stop = min(start + share, numel)
        master = torch.zeros(share, dtype=torch.float32)
        moments: dict[str, Any] = {}
        for k in overlapping(start, stop, part_old):
            entry = old(owners[k])
            sd, path = entry["sd"], entry["path"]
            fp32 = sd[SINGLE_PARTITION_OF_FP32_GROUPS][i]
            if fp32.numel() + sd[GROUP_PADDINGS][i] != part_old:
                raise InvalidInputError(f"{path}: group {i} holds {fp32.numel() + sd[GROUP_PADDINGS][i]} elements, "
                                        f"not the {part_old} of a {len(owners)}-way partition of {numel}")
            base = sd[BASE_OPTIMIZER_STATE]
            param_groups = base["param_groups"]
            saved = base["state"].get(base["param_groups"][i]["params"][0], {})
            lo, hi = max(start, k * part_old), min(stop, k * part_old + fp32.numel())
            src, dst = slice(lo - k * part_old, hi - k * part_old), slice(lo - start, hi - start)
            master[dst] = fp32[src]
            for key, value in saved.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == part_old:
                    moments.setdefault(key, torch.zeros(share, dtype=value.dtype))[dst] = value[src]
                else:  # Adam's step: one value, the same in every partition
                    moments[key] = value.clone() if torch.is_tensor(value) else value
        opt.single_partition_of_fp32_groups[i].data.copy_(master)
        state[i] = moments
    if param_groups is None:  # every share of this rank is padding: nothing to carry over
        param_groups = opt.optimizer.state_dict()["param_groups"]
    opt.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    opt._link_all_hp_params()  # the optimizer state's tensors are new: re-point DeepSpeed's views of them
    return len(files)
