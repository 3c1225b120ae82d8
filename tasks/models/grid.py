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


def build_grid(layout: Layout) -> Grid:
    """Create the process groups of `layout` (collective: every rank calls it; DeepSpeed prints the topology on
    rank 0, callers quiet it). The world must be the layout's."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    topo = topology(layout)
    groups = PipelineParallelGrid(topology=topo)
    coord = layout.coord(tdist.get_rank())
    return Grid(layout, topo, groups, TPGroup(groups.get_slice_parallel_group(), layout, coord))
