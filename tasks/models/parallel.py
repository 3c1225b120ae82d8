"""Megatron-style tensor-parallel pieces shared by every model family.

Why here: each family (GPT, Llama, ...) shards its linears the same way, and the
collectives must run on the pipeline grid's model-parallel group
(`PipelineParallelGrid.get_slice_parallel_group()`), not on DeepSpeed AutoTP
(which crashes inside a PipelineModule). With `tp.size == 1` every piece is the
plain op and issues no collective.

Vocabulary parallelism: the embedding table and the LM head are split by vocab
rows, and the cross entropy is computed from the local logit slices, so no rank
ever holds full-vocab logits.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tasks.base.errors import ConfigError
from tasks.base.layout import ONE_RANK, ORIGIN, Coord, Layout


class TPGroup:
    """What a family's layers are built for: the layout, this rank's coordinates in it, the process group of
    its tensor-parallel slice of the pipeline grid (tp 1 = no TP, no collectives) and, where `layout.ep` > 1,
    of its expert-parallel group (the ep data-parallel ranks a mixture of experts' tokens are dispatched over)."""

    def __init__(self, group: object | None = None, layout: Layout = ONE_RANK, coord: Coord = ORIGIN,
                 ep_group: object | None = None) -> None:
        self.group, self.layout, self.coord, self.ep_group = group, layout, coord, ep_group

    @property
    def rank(self) -> int:
        return self.coord.tp

    @property
    def size(self) -> int:
        return self.layout.tp


def all_reduce(x: torch.Tensor, tp: TPGroup, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """All-reduce a copy of `x` over the TP group (the input is left untouched)."""
    from deepspeed import comm as dist  # timed by DeepSpeed's comms logger (telemetry)

    x = x.contiguous().clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=tp.group)
    return x


class CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_reduce(grad, ctx.tp), None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: object) -> torch.Tensor:
    """All-to-all of rows over `group`: `send[r]` rows of `x` (in rank order) go to rank r, `recv[r]` arrive
    from it (a copy; timed by DeepSpeed's comms logger). Not differentiable: see `all_to_all`."""
    from deepspeed import comm as dist

    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """`exchange` forward; backward, each row's gradient goes back where the row came from (the reverse splits)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: object) -> torch.Tensor:
    """Differentiable `exchange` (a mixture of experts' token dispatch under expert parallelism)."""
    return AllToAll.apply(x, send, recv, group)


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return CopyToTP.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return ReduceFromTP.apply(x, tp) if tp.size > 1 else x


def row_parallel(x: torch.Tensor, lin: nn.Module, tp: TPGroup) -> torch.Tensor:
    """Local matmul, all-reduce across TP, then the (unsharded) bias if the linear has one. A linear carrying a
    LoRA adapter (tasks/models/lora.py LoRALinear) gives its partial output with the adapter's update."""
    y = reduce_from_tp(F.linear(x, lin.weight) if isinstance(lin, nn.Linear) else lin.partial(x), tp)
    return y if lin.bias is None else y + lin.bias


def set_slice(p: torch.Tensor, full: torch.Tensor | None, spec: tuple[int, torch.Tensor] | None,
              layout: Layout) -> None:
    """Copy this rank's slice of the full tensor (`spec`: the family's shard_spec, None = replicated) into `p`
    (`full` None: leave the values, weights are loaded next); a TP-sharded parameter is marked so that
    DeepSpeed's gradient norm counts it on every TP rank."""
    if spec is not None and layout.tp > 1:
        p.tensor_model_parallel = True  # type: ignore[attr-defined]
    if full is not None:
        p.copy_(full if spec is None else full.index_select(spec[0], spec[1]))


def shard_range(size: int, layout: Layout, coord: Coord, field: str) -> tuple[int, int]:
    """[start, end) of a dimension of `size` that the rank at `coord` holds (split across TP); `field` names it
    in the error."""
    if size % layout.tp:
        raise ConfigError(f"{field} ({size}) must be divisible by parallel.tp ({layout.tp})")
    per = size // layout.tp
    return coord.tp * per, (coord.tp + 1) * per


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocab rows: ids outside this rank's rows give zeros, then a TP all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = shard_range(vocab_size, tp.layout, tp.coord, "model.vocab_size")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


def vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """LM head, column-parallel over the vocab: local logits [b, s, vocab/tp] from a [vocab/tp, d] weight."""
    return F.linear(copy_to_tp(x, tp), weight)


class VocabParallelHead(nn.Module):
    """An untied LM head (no bias) holding this rank's vocab rows."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        start, end = shard_range(vocab_size, tp.layout, tp.coord, "model.vocab_size")
        self.weight = nn.Parameter(torch.empty(end - start, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(x, self.weight, self.tp)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy from vocab-sharded logits [n, vocab/tp] (Megatron's vocab-parallel CE).

    Forward: global max (all-reduce MAX), then one all-reduce SUM of (sum of exp, target logit).
    Backward: softmax minus one-hot on this rank's slice, no communication.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = logits.dtype
        logits = logits.float()
        per = logits.shape[-1]
        start = tp.rank * per
        logits = logits - all_reduce(logits.max(dim=-1).values, tp, op="max").unsqueeze(-1)
        local = labels - start
        outside = (local < 0) | (local >= per)
        local = local.masked_fill(outside, 0)
        target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp()
        sums = all_reduce(torch.stack([exp.sum(dim=-1), target]), tp)
        sum_exp, target = sums[0], sums[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        softmax, local, outside = ctx.saved_tensors
        hit = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -hit) * grad.unsqueeze(-1)
        return grad_logits.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 over the whole vocab, from each rank's logit slice."""
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    if tp.size == 1:
        return F.cross_entropy(flat.float(), labels.reshape(-1))
    return _VocabParallelCE.apply(flat, labels.reshape(-1), tp).mean()


# Tokens whose logits one fp32 pass of the evaluation's cross entropy takes: the fp32 copy and its log-softmax of
# 32 rows of a vocabulary stay near the core's cache (a whole window's went through memory: [256, 32000] bf16 logits
# took 15.8 ms, in 32-row passes 7.5 ms on one Xeon core, the same numbers bit for bit).
NLL_ROWS = 32


def vocab_parallel_argmax(logits: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """Each row's highest-logit token id over the whole vocabulary (the first on a tie, as torch's argmax), from
    each rank's vocab slice or, where the head is replicated, from full logits."""
    logits = logits.float()
    if tp.size == 1 or logits.shape[-1] == vocab_size:
        return logits.argmax(dim=-1)
    per = logits.shape[-1]
    local_top, local_index = logits.max(dim=-1)
    top = all_reduce(local_top, tp, op="max")
    index = torch.where(local_top == top, local_index + tp.rank * per, torch.full_like(local_index, vocab_size))
    return -all_reduce(-index, tp, op="max")  # the lowest id among the ranks holding the top logit


def vocab_parallel_token_nll(local_logits: torch.Tensor, labels: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Per-token next-token cross entropy [*labels.shape] in fp32 from each rank's logit slice (evaluation, and a
    packed batch's token-weighted training loss)."""
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    if tp.size == 1 and flat.requires_grad and torch.is_grad_enabled():
        # Training: one pass. In row passes the backward of each slice writes a zero gradient of the whole logits
        # first: quadratic in the rows (a [4096, 32000] batch's backward took 31 s against 0.5 s in one pass).
        nll = F.cross_entropy(flat.float(), labels.reshape(-1), reduction="none")
    elif tp.size == 1:
        targets = labels.reshape(-1)
        nll = torch.cat([F.cross_entropy(flat[i:i + NLL_ROWS].float(), targets[i:i + NLL_ROWS], reduction="none")
                         for i in range(0, flat.shape[0], NLL_ROWS)])
    else:
        nll = _VocabParallelCE.apply(flat, labels.reshape(-1), tp)
    return nll.reshape(labels.shape)
