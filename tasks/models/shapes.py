"""Parameter counts per layer kind (stated by each model family) and how DeepSpeed places layers on stages.

With the models (not the planner) because families state their counts in `ParamCounts` and export
walks the stages; the planner reads both from here. No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one tensor-parallel rank (tp=1: the whole thing)."""

    embedding: int  # the first stage's embedding layer, as held by one TP rank
    block: int  # one transformer block, as held by one TP rank (the largest, where blocks differ)
    head: int  # the last stage's final norm + LM head (a tied copy of the embedding included)
    # Each block's count where blocks differ (a mixture of experts' dense layers); () = every block is `block`.
    per_block: tuple[int, ...] = ()
    # Of each block's count, its routed experts' (a mixture of experts; () = none): under expert parallelism
    # their gradients and ZeRO partitions go over dp / ep ranks, not dp.
    experts_per_block: tuple[int, ...] = ()

    def blocks(self, first: int, count: int) -> int:
        """Parameters of blocks first .. first + count - 1."""
        return sum(self.per_block[first:first + count]) if self.per_block else count * self.block

    def experts(self, first: int, count: int) -> int:
        """Routed expert parameters of blocks first .. first + count - 1."""
        return sum(self.experts_per_block[first:first + count])


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's `ds_utils.partition_balanced` (linear partition DP), ported to plain Python.

    Ported rather than imported so planning never imports DeepSpeed; ties are
    broken exactly as DeepSpeed does, which decides where zero-weight layers
    (embeddings, head) land.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], seg)
                min_sum = min(dp_min[k][j - 1], seg)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


# Layer specs of the PipelineModule, in order. The trainer builds
# [embedding, block x n_layers, head]; "type:TransformerBlock" gives blocks weight 1.
EMBED, BLOCK, HEAD = "embedding", "block", "head"

# DeepSpeed `partition_method`s (a regex over the layer classes' names; matched layers weigh 1, others 0).
TRAINING_PARTITION = "type:TransformerBlock"
# Evaluation runs forward only, so compute sets its pace: the head (logits over the vocabulary and their
# cross entropy) weighs like one more block, not nothing -- at 20 layers the last stage did 1.28x the first's
# work and the pipeline waited on it (issue 27). (An 8B Llama's head is ~2.4 blocks of compute, a 70B's ~1.2.)
EVALUATION_PARTITION = "type:^(TransformerBlock|Head)$"


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds."""

    index: int
    blocks: int
    has_embedding: bool
    has_head: bool
    first_block: int = 0  # the model's index of its first block

    def params(self, counts: ParamCounts) -> int:
        return (
            counts.blocks(self.first_block, self.blocks)
            + (counts.embedding if self.has_embedding else 0)
            + (counts.head if self.has_head else 0)
        )

    def experts(self, counts: ParamCounts) -> int:
        """Of `params`, the routed experts'."""
        return counts.experts(self.first_block, self.blocks)


def windows_per_forward(batch_size: int, pp: int) -> int:
    """Windows one evaluation forward holds: a whole batch on a single stage; across stages one window at a
    time, so a stage waits for one window, not the whole batch, before its first (the pipeline's fill: 2.2
    of 28 s at 20 layers on 2 stages, batches of 2; issue 27)."""
    return batch_size if pp == 1 else 1


# An evaluation stage's sends the next stage has not received yet (tasks/evaluate/sharded.py): each one forward's
# activations. With them the stage also holds the forward it computes from and the next one's posted receive.
EVALUATION_SENDS_IN_FLIGHT = 2


def evaluation_p2p_buffers(pp: int) -> int:
    """Forwards' activations an evaluation stage holds for the stages around it (0 on a single stage)."""
    return EVALUATION_SENDS_IN_FLIGHT + 2 if pp > 1 else 0


def pipeline_stages(n_layers: int, pp: int, partition: str = TRAINING_PARTITION) -> list[Stage]:
    """Stages as DeepSpeed's PipelineModule builds them with `partition` (one of the two above)."""
    if partition not in (TRAINING_PARTITION, EVALUATION_PARTITION):
        raise ValueError(f"unknown partition {partition!r}")
    specs = [EMBED] + [BLOCK] * n_layers + [HEAD]
    if pp == 1:
        return [Stage(0, n_layers, True, True)]
    weighed = {BLOCK, HEAD} if partition == EVALUATION_PARTITION else {BLOCK}
    parts = partition_balanced([1 if s in weighed else 0 for s in specs], pp)
    stages = []
    for i in range(pp):
        held = specs[parts[i] : parts[i + 1]]
        stages.append(Stage(i, held.count(BLOCK), EMBED in held, HEAD in held, specs[:parts[i]].count(BLOCK)))
    return stages
