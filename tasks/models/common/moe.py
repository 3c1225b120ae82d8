"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) on the rotary decoder's attention: a router, stacked experts,
dropless top-k routing exactly as transformers 5 computes it.

Why stacked: transformers 5 holds a layer's routed experts as two 3-D parameters, `gate_up [E, 2I, H]` (gate
rows first) and `down [E, H, I]`: one reference tensor per layer and kind, one grouped matmul's operand (the
per-expert layout checkpoints hold is stacked on read, tasks/models/weights.py, and written back by an export,
the family's `hf_tensors`). Dropless: every token reaches its k experts (no capacity), so the logits are
transformers'. The auxiliary load-balancing loss: RouterAux.

Tensor parallelism: every expert is split along its hidden units like the dense MLP (gate/up rows, down columns),
the router is replicated. A token's output is the sum of its experts' partial outputs, all-reduced once; the
routing weights' gradient is summed over the TP ranks (each rank saw only its share of every expert). Expert
parallelism (`parallel.ep`): see Experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tasks.config.model import ModelConfig
from tasks.models.common import blocks
from tasks.models.common import reference as common
from tasks.models.common.moe_sharding import expert_range, full_shapes, shard_spec
from tasks.models.common.packing import Packing, pack, unpack
from tasks.models.grid import expert_group_name
from tasks.models.parallel import TPGroup, all_to_all, copy_to_tp, exchange, reduce_from_tp


class Router(nn.Module):
    """Softmax over all experts in fp32, the top k, renormalised when `norm_topk_prob` (Mixtral always)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        assert m.num_experts is not None and m.num_experts_per_tok is not None
        self.k, self.renormalise = m.num_experts_per_tok, m.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(m.num_experts, m.d_model))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [n, E], their fp32 probabilities, top-k weights [n, k] in fp32, their experts [n, k]) of
        tokens x [n, H]."""
        logits = F.linear(x, self.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.k, dim=-1)
        if self.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, probs, top, chosen


def grouped_mm_supported(x: torch.Tensor, width: int) -> bool:
    """Whether `torch._grouped_mm` runs the experts of activations `x` (hidden size x.shape[-1], expert width
    `width` on this rank): on CPU in every dtype (the same numbers as a loop of matmuls, measured 1.9x faster on
    one core); on CUDA its kernel takes bf16 on Hopper and later, with 16-byte aligned rows."""
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and width % 8 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class Experts(nn.Module):
    """This rank's experts (all E, or its E / ep under expert parallelism), each its TP rank's share of the
    expert's SwiGLU: gate_up [E/ep, 2I/tp, H] (its gate rows, then its up rows), down [E/ep, H, I/tp].

    Expert parallelism (ep > 1): every rank routes its own tokens; each (token, pick) row goes to the rank holding
    its expert and its output comes back, by two all-to-alls over the expert-parallel group (differentiable: the
    backward runs them reversed), so each expert computes on the tokens of all ep ranks. The experts' parameters
    are marked for DeepSpeed (`allreduce` False, `group_name`): their gradients are reduced over the ranks that
    hold the same experts (the expert-data-parallel group), not over every data-parallel rank."""

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        assert m.num_experts is not None
        width = m.expert_ffn // tp.size
        self.ep, self.ep_group = tp.layout.ep, tp.ep_group
        self.local = m.num_experts // self.ep  # experts on this rank: [coord.ep * local, (coord.ep + 1) * local)
        self.act: Callable[[torch.Tensor], torch.Tensor] = F.silu
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * width, m.d_model))
        self.down = nn.Parameter(torch.empty(self.local, m.d_model, width))
        if self.ep > 1:
            for p in (self.gate_up, self.down):
                p.allreduce, p.group_name = False, expert_group_name(self.ep)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """sum_k weights[:, k] * expert_chosen[:, k](x) of tokens x [n, H] (this rank's partial sum).

        The (token, slot) picks in one stable sort by expert, as transformers' eager experts take them; each
        expert gathers its rows (index_select) and the weighted outputs are added back in that order
        (index_add): a token's experts are summed in ascending order at any ep."""
        k = chosen.shape[1]
        picks = chosen.flatten()
        order = picks.argsort(stable=True)
        token, slot = order // k, order % k
        rows = x.index_select(0, token)
        counts = torch.bincount(picks, minlength=self.local * self.ep)
        y = self._dispatched(rows, counts) if self.ep > 1 else self._compute(rows, counts)
        y = y * weights[token, slot, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def _compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert's SwiGLU of its consecutive run of `rows` (`counts` rows per local expert): two
        grouped matmuls (one kernel each for all the experts) where torch has them for the device, else a loop."""
        if grouped_mm_supported(rows, self.down.shape[-1]):
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(self.act(gate) * up, self.down.transpose(1, 2), offs=offsets)
        outs, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                h = rows[start:start + count]
                gate, up = F.linear(h, self.gate_up[expert]).chunk(2, dim=-1)
                outs.append(F.linear(self.act(gate) * up, self.down[expert]))
                start += count
        return torch.cat(outs) if outs else rows.new_zeros(0, self.down.shape[1])

    def _dispatched(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs of `rows` (sorted by expert, `counts` [E] per expert) computed where each expert
        lives: rows out to their experts' ranks, outputs back, in the same order."""
        per_expert = counts.view(self.ep, self.local)  # [destination rank, its local expert]
        received = exchange(per_expert, [1] * self.ep, [1] * self.ep, self.ep_group)  # [source rank, local expert]
        send, recv = per_expert.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        arrived = all_to_all(rows, send, recv, self.ep_group)
        # Arrived by source rank, each source's rows by local expert: regroup by expert (stable: sources in
        # rank order), compute, and put the outputs back in arrival order.
        local = torch.arange(self.local, device=received.device)
        expert_of = torch.repeat_interleave(local.repeat(self.ep), received.flatten())
        by_expert = expert_of.argsort(stable=True)
        out = self._compute(arrived.index_select(0, by_expert), received.sum(dim=0))
        return all_to_all(out.index_select(0, by_expert.argsort()), recv, send, self.ep_group)


class RouterAux(torch.autograd.Function):
    """One MoE layer's part of transformers' auxiliary load-balancing loss, exact across pipeline stages.

    transformers' loss over a forward's L MoE layers and T tokens is E * sum_e f_e P_e, f_e = (top-k picks of
    expert e in all layers) / (L T), P_e = (router probabilities of e summed over all layers' tokens) / (L T):
    a layer's gradient needs every layer's picks, later stages' included, while stages exchange only
    activations. So the activations carry a `carrier` [2, E] (picks, probabilities summed so far): forward, each
    layer adds its own; the head turns it into the loss value and, backward, hands it the gradient g * picks
    (g: whatever scales the loss, 1 / micro-batches, a loss scale), which flows back unchanged through every
    layer. Each layer adds d(coef * aux)/d(its router logits) = scale * p (S - <p, S>) for S = that gradient,
    scale = coef * E / (L T)^2 (as Megatron-Core's MoEAuxLossAutoScaler adds its aux gradient in backward)."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,  # type: ignore[override]
                picks: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(probs)
        ctx.scale, ctx.dtype = scale, logits.dtype
        picks = picks.to(carrier.dtype)  # each expert's top-k picks in this layer
        return carrier + torch.stack([picks, probs.sum(dim=0).to(carrier.dtype)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (probs,) = ctx.saved_tensors
        picks = grad[0].to(probs.dtype)
        grad_logits = ctx.scale * probs * (picks - (probs * picks).sum(dim=-1, keepdim=True))
        return grad, grad_logits.to(ctx.dtype), None, None, None


class AuxLoss(torch.autograd.Function):
    """The carrier's end in the head: forward coef * transformers' auxiliary loss, E * sum_e f_e P_e;
    backward the gradient g * picks every layer's RouterAux reads (see there)."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(carrier)
        return scale * (carrier[0] * carrier[1]).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (carrier,) = ctx.saved_tensors
        return torch.stack([grad * carrier[0], torch.zeros_like(carrier[1])]), None


def aux_scale(m: ModelConfig, tokens: int) -> float:
    """coef * E / (L T)^2 of a forward of `tokens` tokens through the model's L MoE layers."""
    assert m.num_experts is not None
    layers = sum(m.routed(i) for i in range(m.n_layers))
    return m.router_aux_loss_coef * m.num_experts / (layers * tokens) ** 2


class SparseMoE(nn.Module):
    """Route each token to its k experts and sum their weighted outputs (one TP all-reduce).

    `cast_weights`: the routing weights are cast to the activations' dtype before they scale the experts'
    outputs (Qwen3-MoE); Mixtral scales in fp32 and casts the product."""

    cast_weights = True

    def __init__(self, m: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.m = tp, m
        self.router = Router(m)
        self.experts = Experts(m, tp)
        # Each expert's picks in training since `take_expert_loads` last read them (telemetry: a collapsing router
        # shows as one expert taking most tokens); not state: no checkpoint or export holds it.
        self.register_buffer("load", torch.zeros(m.num_experts or 0, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, carrier: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the experts' weighted sum, the carrier with this layer's routing added: see RouterAux)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, probs, weights, chosen = self.router(flat)
        # Counted in the forward pass only: an activation-checkpointing recompute runs inside the backward pass.
        counting = self.training and torch._C._current_graph_task_id() == -1
        if counting or carrier is not None:  # each expert's picks, counted once for both
            picks = torch.bincount(chosen.flatten(), minlength=self.load.shape[0])
            if counting:
                self.load += picks
            if carrier is not None:
                carrier = RouterAux.apply(carrier, logits, probs.detach(), picks, aux_scale(self.m, flat.shape[0]))
        if self.cast_weights:
            weights = weights.to(x.dtype)
        out = self.experts(copy_to_tp(flat, self.tp), copy_to_tp(weights, self.tp), chosen)
        return reduce_from_tp(out, self.tp).reshape(shape), carrier


Routed = torch.Tensor | tuple[torch.Tensor, ...]


def split(inputs: Routed) -> tuple[torch.Tensor, Packing | None, torch.Tensor | None]:
    """(activations or tokens, packing, carrier) of what a routed model's layer receives: `x`, `(x, carrier)`,
    a packed window's `(x, position_ids, doc_ids)` or `(x, position_ids, doc_ids, carrier)`."""
    if not isinstance(inputs, tuple):
        return inputs, None, None
    if len(inputs) == 2:
        return inputs[0], None, inputs[1]
    x, packing = unpack(inputs[:3])
    return x, packing, inputs[3] if len(inputs) == 4 else None


def join(x: torch.Tensor, packing: Packing | None, carrier: torch.Tensor | None) -> Routed:
    """What a routed model's layer passes on (the inverse of `split`)."""
    out = pack(x, packing)
    if carrier is None:
        return out
    return (*out, carrier) if isinstance(out, tuple) else (out, carrier)


def carries(m: ModelConfig, module: nn.Module) -> bool:
    """Whether the activations carry the auxiliary loss's carrier: training with a coefficient."""
    return module.training and m.router_aux_loss_coef > 0


class Embedding(blocks.Embedding):
    """Llama's embedding; in training with the auxiliary loss, its output carries an empty carrier (RouterAux)."""

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__(m, seed, tp)
        self.m = m

    def forward(self, inputs: Routed) -> Routed:
        out = super().forward(inputs)
        if not carries(self.m, self):
            return out
        assert self.m.num_experts is not None
        x, packing = unpack(out)
        return join(x, packing, torch.zeros(2, self.m.num_experts, device=x.device, requires_grad=True))


class Head(blocks.Head):
    """Llama's head; a carrier it receives becomes coef * the auxiliary loss, passed on next to the logits."""

    def __init__(self, m: ModelConfig, seed: int | None, tp: TPGroup | None = None) -> None:
        super().__init__(m, seed, tp)
        self.m = m

    def forward(self, inputs: Routed) -> Routed:
        x, _, carrier = split(inputs)
        if carrier is None:
            return super().forward(x)
        tokens = x.shape[0] * x.shape[1]
        return super().forward(x), AuxLoss.apply(carrier, aux_scale(self.m, tokens))


class TransformerBlock(blocks.TransformerBlock):
    """Llama's pre-norm block whose MLP is a mixture of experts where `m.routed(index)` (else the dense MLP)."""

    moe: type[SparseMoE] = SparseMoE

    def __init__(self, m: ModelConfig, index: int, seed: int | None, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        tp = tp or TPGroup()
        self.index, self.ref_prefix = index, f"blocks.{index}"
        self.attn_norm = blocks.RMSNorm(m.d_model, m.rms_norm_eps)
        self.attn = blocks.Attention(m, tp)
        self.mlp_norm = blocks.RMSNorm(m.d_model, m.rms_norm_eps)
        self.mlp = self.moe(m, tp) if m.routed(index) else blocks.MLP(m, tp)
        blocks.init_layer(self, m, index + 1, seed, tp, shapes=full_shapes, shards=shard_spec, experts=expert_range)

    def forward(self, inputs: Routed) -> Routed:
        """`inputs`: see `split` (a packed window's positions and documents pass through, as in a dense block)."""
        x, packing, carrier = split(inputs)
        x = x + self.attn(self.attn_norm(x), packing)
        if isinstance(self.mlp, SparseMoE):
            y, carrier = self.mlp(self.mlp_norm(x), carrier)
        else:
            y = self.mlp(self.mlp_norm(x))
        return join(x + y, packing, carrier)


def take_expert_loads(module: nn.Module) -> dict[int, list[int]]:
    """Each MoE layer of `module` (a pipeline stage, or a whole model) by block index: its experts' picks since
    the last call, which resets them."""
    out = {}
    for block in module.modules():
        if isinstance(block, TransformerBlock) and isinstance(block.mlp, SparseMoE):
            out[block.index] = block.mlp.load.tolist()
            block.mlp.load.zero_()
    return out


class Reference(common.Reference):
    """The whole mixture-of-experts model in one module (tp=1: full logits)."""

    Embedding, TransformerBlock, Head = Embedding, TransformerBlock, Head


def pipeline_layers(m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """Llama's pipeline plan with the mixture-of-experts blocks."""
    return blocks.pipeline_layers(m, seed, tp, Reference)


def make_loss_fn(tp: TPGroup) -> Callable[[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor],
                                          torch.Tensor]:
    """loss_fn(local logits, or (local logits, coef * auxiliary loss) when it trains, labels): the mean next-token
    cross entropy plus the auxiliary loss, as transformers' loss with `output_router_logits`."""
    cross_entropy = blocks.make_loss_fn(tp)

    def loss_fn(outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, tuple):
            return cross_entropy(outputs[0], labels) + outputs[1]
        return cross_entropy(outputs, labels)

    return loss_fn
