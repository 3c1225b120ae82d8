"""A layout's DeepSpeed topology and process groups, built once per process (the trainer's and the evaluation
ranks' alike), and this rank's place in them.

Why one builder: the topology's rank order is the layout's (tasks/base/layout.py, pinned against DeepSpeed's by
tests/models/test_layout.py); built in one place, the trainer and the evaluation cannot disagree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from tasks.base.layout import Coord, Layout
from tasks.models.parallel import TPGroup


@dataclass(frozen=True)
class Grid:
    """The topology (for `PipelineModule`), the pipeline grid (its process groups), and this rank's TP group."""

    layout: Layout
    topology: Any  # deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology
    groups: Any  # deepspeed.runtime.pipe.topology.PipelineParallelGrid
    tp: TPGroup

    @property
    def coord(self) -> Coord:
        return self.tp.coord


def topology(layout: Layout) -> Any:
    """DeepSpeed's topology of `layout` (no process groups: usable before or without torch.distributed)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name of the expert-parallel groups of size `ep` (a parameter's `group_name`)."""
    return f"ep_size_{ep}"


def build_grid(layout: Layout) -> Grid:
    """Create the process groups of `layout` (collective: every rank calls it; DeepSpeed prints the topology on
    rank 0, callers quiet it). The world must be the layout's."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    topo = topology(layout)
    groups = PipelineParallelGrid(topology=topo)
    coord = layout.coord(tdist.get_rank())
    ep_group = _expert_groups(layout, groups, coord) if layout.ep > 1 else None
    return Grid(layout, topo, groups, TPGroup(groups.get_slice_parallel_group(), layout, coord, ep_group))


def _expert_groups(layout: Layout, grid: Any, coord: Coord) -> Any:
    """DeepSpeed's expert-parallel and expert-data-parallel groups (its ZeRO optimizer reduces and partitions the
    experts' gradients over the latter), created once here; this rank's expert-parallel group. Checked against
    the layout's own rule: ep consecutive data-parallel ranks of one stage and TP index."""
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = grid
    ds_groups._create_expert_data_and_model_parallel(layout.ep, mpu=grid)
    name = expert_group_name(layout.ep)
    expected = [layout.rank(Coord(pp=coord.pp, dp=dp, tp=coord.tp)) for dp in layout.expert_group(coord.dp)]
    if list(ds_groups._get_expert_parallel_group_ranks(name)) != expected:
        raise RuntimeError(f"DeepSpeed's expert-parallel group {ds_groups._get_expert_parallel_group_ranks(name)} "
                           f"is not the layout's {expected}")
    return ds_groups._get_expert_parallel_group(name)
