"""A model held by the evaluation ranks in a tp x pp x dp layout, scored without an optimizer or engine.

Why not DeepSpeed's engine: evaluation needs only the forward pass, and an engine
would allocate gradients and optimizer states (12 bytes a parameter at 70B). Each
rank builds its stage's layers with the training code (`PipelineModule` over the
family's layer specs: the same tensor-parallel slices; stages balanced for a forward pass,
`EVALUATION_PARTITION`), loads its slice of the weights, and the stages hand activations along,
one window at a time, with point-to-point sends between ranks of the same (data, model) coordinates.
Every DP replica is a complete model; replicas score different batches.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tasks.base.layout import Layout
from tasks.base.model_files import DTYPES
from tasks.config.model import ModelConfig
from tasks.config.schema import LoraConfig
from tasks.models import get_family
from tasks.models.common.init import no_default_init
from tasks.models.common.packing import Packing, pack, unpack
from tasks.models.grid import build_grid
from tasks.models.lora import apply_lora
from tasks.models.lora_export import PeftAdapter, load_adapter
from tasks.models.parallel import vocab_parallel_argmax
from tasks.models.shapes import EVALUATION_PARTITION, EVALUATION_SENDS_IN_FLIGHT, windows_per_forward
from tasks.models.weights import load_into, open_weights, round_to
from tasks.train.rank import deepspeed_prints_to_debug


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are `dtype` (the families compute their rotary tables in fp32 explicitly)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class ShardedModel:
    """This rank's part of the model, and the collective forward that turns windows into per-token NLL."""

    def __init__(self, m: ModelConfig, weights: Path, layout: Layout, *,
                 as_dtype: str | None, dtype: str, lora: LoraConfig | None = None,
                 adapter: Path | None = None) -> None:
        """`as_dtype`: each weight first rounded to it (a candidate scored as it will be published); `dtype`: the
        dtype held and computed in (`evaluate.dtype`); `lora`: the model is the base at `weights` plus adapters,
        read from `weights` too (a LoRA run's checkpoint) or from the PEFT directory `adapter` (a published
        adapter)."""
        from deepspeed.pipe import PipelineModule

        self.m, self.pp, self.dp = m, layout.pp, layout.dp
        with deepspeed_prints_to_debug():  # rank 0 prints "Using topology: {...}"
            self.grid = build_grid(layout)
        self.tp = self.grid.tp
        self.stage, self.dp_rank = self.grid.coord.pp, self.grid.coord.dp
        family = get_family(m.family)
        self.dtype = getattr(torch, DTYPES[dtype])
        # Built in the compute dtype, adapters too: a bf16 rank never holds its stage in fp32, not even while loading.
        with default_dtype(self.dtype):
            with deepspeed_prints_to_debug(), no_default_init():  # the weights are loaded next
                self.module = PipelineModule(layers=family.pipeline_layers(m, None, self.tp),
                                             topology=self.grid.topology, partition_method=EVALUATION_PARTITION)
            load_into(self.module, weights, m, self.tp)
            if lora is not None:  # the base is in place: wrap its targeted linears, then load the adapters
                apply_lora(self.module, m, lora, self.tp, seed=0)
                load_adapter(self.module, open_weights(weights, m) if adapter is None else PeftAdapter(adapter, m),
                             m, self.tp)
        if as_dtype is not None:
            round_to(self.module, as_dtype)
        self.module.eval()
        self.device = next(self.module.parameters()).device  # DeepSpeed places the stage on this rank's device
        self.token_nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = family.make_token_nll_fn(self.tp)
        self._peer = {s: layout.rank(dataclasses.replace(self.grid.coord, pp=s)) for s in range(layout.pp)}

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @torch.no_grad()
    def forward_nll(self, windows: torch.Tensor) -> torch.Tensor | None:
        """Per-token NLL [B, seq_len] of [B, seq_len + 1] windows on the last stage (None on the others).
        Collective over this DP replica's ranks: each of them calls it with the same windows."""
        return self.score(windows[:, :-1], windows[:, 1:])

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, targets: torch.Tensor, packing: Packing | None = None
              ) -> torch.Tensor | None:
        """Per-token NLL [B, T] of `targets` after `tokens` [B, T] on the last stage (None on the others); a packed
        batch's `packing` (positions, documents) is known to every rank of the replica, so only the activations
        cross the stages, `windows_per_forward` windows at a time. Collective over this DP replica's ranks."""
        chunks = self._chunks(tokens)
        scored = [self.token_nll(out, targets[rows].to(self.device))
                  for rows, out in zip(chunks, self._forwards(tokens, chunks, packing), strict=True)
                  if out is not None]
        return torch.cat(scored) if self.last_stage else None

    @torch.no_grad()
    def loglikelihoods(self, tokens: torch.Tensor, targets: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-token NLL [B, T] of `targets` after `tokens`, and whether each target is the greedy token there
        (lm-eval's logprob and is_greedy), on the last stage (None on the others). Collective over this DP
        replica's ranks."""
        chunks = self._chunks(tokens)
        nll, greedy = [], []
        for rows, out in zip(chunks, self._forwards(tokens, chunks), strict=True):
            if out is not None:
                y = targets[rows].to(self.device)
                nll.append(self.token_nll(out, y))
                greedy.append(vocab_parallel_argmax(out, self.tp, self.m.vocab_size) == y)
        return (torch.cat(nll), torch.cat(greedy)) if self.last_stage else None

    @torch.no_grad()
    def next_tokens(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The greedy next token [B] after position `last[b]` of each row of `tokens` [B, T] (right-padded), on
        every rank of this DP replica (one generation step; all of them call it with the same tokens)."""
        chunks = self._chunks(tokens)
        picked = []
        for rows, out in zip(chunks, self._forwards(tokens, chunks), strict=True):
            if out is not None:
                at = out[torch.arange(out.shape[0], device=out.device), last[rows].to(out.device)]
                picked.append(vocab_parallel_argmax(at, self.tp, self.m.vocab_size))
        result = torch.cat(picked) if self.last_stage else torch.empty(tokens.shape[0], dtype=torch.long,
                                                                        device=self.device)
        if self.pp > 1:
            tdist.broadcast(result, src=self._peer[self.pp - 1], group=self.grid.groups.get_pipe_parallel_group())
        return result.cpu()

    def _chunks(self, tokens: torch.Tensor) -> list[slice]:
        """The row slices of `tokens` that go through the stages together (`windows_per_forward` rows each)."""
        step = windows_per_forward(tokens.shape[0], self.pp)
        return [slice(i, i + step) for i in range(0, tokens.shape[0], step)]

    def _forwards(self, tokens: torch.Tensor, chunks: list[slice], packing: Packing | None = None
                  ) -> Iterator[torch.Tensor | None]:
        """The last stage's logits of each chunk of `tokens` in turn (None on the other stages, which pass
        activations on). Pipelined: a stage posts the receive of its next chunk before it computes this one and
        leaves up to `EVALUATION_SENDS_IN_FLIGHT` sends in flight, so neighbouring stages compute different chunks
        at once. With a blocking send and receive per chunk a stage could start a chunk only once its neighbour
        had finished the one before, and each waited on the other. Every send has completed when the loop ends."""
        def receive(rows: slice) -> tuple[torch.Tensor, Any]:
            shape = (*tokens[rows].shape, self.m.d_model)
            hidden = torch.empty(shape, device=self.device, dtype=self.dtype)
            return hidden, tdist.irecv(hidden, src=self._peer[self.stage - 1])

        sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()  # (work, the tensor it sends)
        posted = receive(chunks[0]) if self.stage > 0 else None
        try:
            for n, rows in enumerate(chunks):
                if posted is None:
                    hidden = tokens[rows].to(self.device)
                else:
                    hidden, work = posted
                    work.wait()
                    posted = receive(chunks[n + 1]) if n + 1 < len(chunks) else None
                placed = None if packing is None else (packing[0][rows].to(self.device),
                                                       packing[1][rows].to(self.device))
                out = self.module(pack(hidden, placed))
                if self.last_stage:
                    yield out
                    continue
                sent = unpack(out)[0].contiguous()
                sends.append((tdist.isend(sent, dst=self._peer[self.stage + 1]), sent))
                while len(sends) > EVALUATION_SENDS_IN_FLIGHT:
                    sends.popleft()[0].wait()
                yield None
        finally:
            for work, _ in sends:
                work.wait()

    @torch.no_grad()
    def nll(self, windows: torch.Tensor) -> torch.Tensor:
        """Per-token NLL [B, seq_len] of [B, seq_len + 1] windows, on every rank of this DP replica (user
        metrics call this; all of the replica's ranks must call it with the same windows)."""
        local = self.forward_nll(windows)
        result = local if local is not None else torch.empty(windows.shape[0], windows.shape[1] - 1,
                                                             device=self.device)
        if self.pp > 1:
            tdist.broadcast(result, src=self._peer[self.pp - 1], group=self.grid.groups.get_pipe_parallel_group())
        return result
