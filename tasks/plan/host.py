"""What one node's host memory holds: the process memory of the ranks placed on it, added up.

Why a check of its own: on GPUs a rank's host RSS is small beside its device memory until it saves. A save copies
the rank's weights and optimizer states to host memory so training goes on while a thread writes them
(tasks/train/async_save.py), as large as its device share of the model states, and every rank of a node saves at
once: Llama 70B on 32 GPUs (tp 8, pp 2, dp 2) holds ~33 GiB per rank, ~266 GiB on each 8-GPU node, at every
save. A node with less RAM is OOM-killed at the first save, hours into the run. Ranks are placed node-major
(global rank = node x ranks per node + local rank: torchrun's order, which every launcher here uses), in the
layout's rank order; training and evaluation are separate jobs, so a node holds the larger of the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from tasks.base.layout import Layout


def node_peak_bytes(layout: Layout, ranks_per_node: int, stage_peaks: Sequence[int]) -> int:
    """The largest sum, over the ranks of one node, of their pipeline stage's process peak (`stage_peaks[s]`)."""
    world = layout.world_size
    per_node = min(ranks_per_node, world)
    return max(sum(stage_peaks[layout.coord(rank).pp] for rank in range(first, min(first + per_node, world)))
               for first in range(0, world, per_node))
