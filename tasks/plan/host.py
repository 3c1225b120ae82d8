"""What one node's host memory holds: the process memory of the ranks placed on it, added up.

Why a check of its own: on GPUs a rank's host RSS is small beside its device memory until it saves. A save copies
the rank's weights and optimizer states to host memory so training goes on while a thread writes them
(tasks/train/async_save.py), as large as its device share of the model states, and every rank of a node saves at
once: Llama 70B on 32 GPUs (tp 8, pp 2, dp 2) holds ~33 GiB per rank, ~266 GiB on each 8-GPU node, at every
save. A node with less RAM is OOM-killed at the first save, hours into the run. Ranks are placed node-major
(global rank = node x ranks per node + local rank: torchrun's order, which every launcher here uses), in the
layout's rank order; training and evaluation are separate jobs, so a node holds the larger of the two.

The `local` launcher's node is the planning machine itself: without `cluster.host_memory_gib` its capacity is
this machine's memory (its container's limit, when lower), so a local run that cannot fit is refused before a
rank starts instead of being OOM-killed at its first save.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tasks.base.layout import Layout


def node_peak_bytes(layout: Layout, ranks_per_node: int, stage_peaks: Sequence[int]) -> int:
    """The largest sum, over the ranks of one node, of their pipeline stage's process peak (`stage_peaks[s]`)."""
    world = layout.world_size
    per_node = min(ranks_per_node, world)
    return max(sum(stage_peaks[layout.coord(rank).pp] for rank in range(first, min(first + per_node, world)))
               for first in range(0, world, per_node))


# A container's memory limit: cgroup v2, then v1 (whose "no limit" is a huge number, as v2's is "max").
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def this_machine_memory_bytes() -> int:
    """The host memory this machine's processes can hold together: its RAM, or its container's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total
