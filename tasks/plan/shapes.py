"""Exact parameter counts of our GPT and how DeepSpeed places its layers on pipeline stages.

Kept separate from the budget arithmetic because the measured-vs-predicted tests
check these numbers against the real model, tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one tensor-parallel rank (tp=1: the whole thing)."""

    embedding: int  # token vocab x d (no bias) + learned positions seq_len x d
    block: int  # one transformer block, as held by one TP rank
    head: int  # final LayerNorm + untied LM head d -> vocab (no bias)


def param_counts(m: ModelConfig, tp: int = 1) -> ParamCounts:
    """Per-TP-rank parameter counts; column/row-parallel weights are sharded, LNs and row biases replicated."""
    d, hd = m.d_model, m.head_dim
    qkv_out = (m.n_heads + 2 * m.kv_heads) * hd
    ln = 2 * d  # weight + bias
    sharded = (d * qkv_out + qkv_out) + (m.n_heads * hd * d) + (d * m.ffn + m.ffn) + (m.ffn * d)
    replicated = 2 * ln + d + d  # two LayerNorms + out-proj bias + MLP fc2 bias
    return ParamCounts(
        embedding=m.vocab_size * d + m.seq_len * d,
        block=replicated + sharded // tp,
        head=ln + d * m.vocab_size,
    )


def total_params(m: ModelConfig) -> int:
    """Exact parameter count of the unsharded model."""
    c = param_counts(m, 1)
    return c.embedding + m.n_layers * c.block + c.head


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


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds."""

    index: int
    blocks: int
    has_embedding: bool
    has_head: bool

    def params(self, counts: ParamCounts) -> int:
        return (
            self.blocks * counts.block
            + (counts.embedding if self.has_embedding else 0)
            + (counts.head if self.has_head else 0)
        )


def pipeline_stages(n_layers: int, pp: int) -> list[Stage]:
    """Stages as DeepSpeed's partition_method="type:TransformerBlock" would build them."""
    specs = [EMBED] + [BLOCK] * n_layers + [HEAD]
    if pp == 1:
        return [Stage(0, n_layers, True, True)]
    parts = partition_balanced([1 if s == BLOCK else 0 for s in specs], pp)
    stages = []
    for i in range(pp):
        held = specs[parts[i] : parts[i + 1]]
        stages.append(Stage(i, held.count(BLOCK), EMBED in held, HEAD in held))
    return stages
