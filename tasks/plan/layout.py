"""Does tp x pp x dp fit the machines the config names? Checked by the planner, before anything is held.

Why here and not at config load: the planner may be asked about another GPU count (`--gpus`,
`--search`), and DAG overrides change the layout after load; the budget is where a layout meets
the hardware. Multi-node engines fill whole nodes (the bandwidth model assumes consecutive ranks
share a node of `ranks_per_node`); `local` runs every rank on this one machine, which must have
room for them (on CPU a "GPU" is one rank process).
"""

from __future__ import annotations

from tasks.base.errors import InvalidInputError
from tasks.config.cluster import ClusterConfig
from tasks.config.schema import JobConfig


def ranks_per_node(c: ClusterConfig) -> tuple[int, str]:
    """Ranks on each node, and the field that says so."""
    if c.nproc_per_node:
        return c.nproc_per_node, "cluster.nproc_per_node"
    return c.gpus_per_node, "cluster.gpus_per_node"


def _nodes(c: ClusterConfig) -> tuple[int, str]:
    """Nodes of a multi-node engine, and the field that says so."""
    if c.launcher == "ssh":
        return len(c.hosts), "cluster.hosts"
    if c.launcher == "slurm":
        return c.slurm.nodes, "cluster.slurm.nodes"
    return c.kubernetes.nodes, "cluster.kubernetes.nodes"


def validate_layout(cfg: JobConfig, world_size: int | None = None) -> None:
    """Refuse a layout the cluster cannot run; `world_size` (--gpus, --search) replaces the cluster's count."""
    lay, c = cfg.parallel.layout, cfg.cluster
    layout = f"parallel.tp x pp x dp = {lay.world_size}"
    per_node, per_node_field = ranks_per_node(c)
    if world_size is not None:
        if world_size <= 0:
            raise InvalidInputError(f"--gpus must be positive, got {world_size}")
        if lay.world_size != world_size:
            raise InvalidInputError(f"parallel.tp x pp x dp = {lay.world_size} ({lay.describe()}) "
                                    f"does not match the GPU count {world_size}")
    elif c.launcher == "local":
        if c.nproc_per_node and lay.world_size != per_node:
            raise InvalidInputError(f"{layout} but cluster.launcher local (1 node) x {per_node_field} "
                                    f"({per_node}) = {per_node}")
        if lay.world_size > per_node:
            raise InvalidInputError(f"{layout} but cluster.launcher local runs 1 node of at most {per_node_field} "
                                    f"({per_node}) ranks")
    else:
        nodes, nodes_field = _nodes(c)
        if lay.world_size != nodes * per_node:
            raise InvalidInputError(f"{layout} but {nodes_field} ({nodes}) x {per_node_field} ({per_node}) "
                                    f"= {nodes * per_node}")
    if lay.world_size > per_node and per_node % lay.tp:
        raise InvalidInputError(f"parallel.tp ({lay.tp}) must fit inside one node: it must divide {per_node_field} "
                                f"({per_node}) so that no tensor-parallel group spans two nodes")
