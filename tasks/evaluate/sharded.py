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
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

P = TypeVar("P")  # what a caller passes along with a batch and gets back with its result


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
        """Per-token NLL [B, seq_len] of [B, seq_len + 1] windows on the last stage (None on the others): one batch
        of `score_batches`. Collective over this DP replica's ranks: each of them calls it with the same windows."""
        [(_, nll)] = self.score_batches([(windows[:, :-1], windows[:, 1:], None, None)])  # every send completed
        return nll

    @torch.no_grad()
    def score_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, Packing | None, P]]
                      ) -> Iterator[tuple[P, torch.Tensor | None]]:
        """Each batch's per-token NLL [B, T] of `targets` after `tokens` [B, T] on the last stage (None on the
        others), with the batch's `payload` (anything the caller needs with its result), in order. A packed
        batch's `packing` (positions, documents) is known to every rank of the replica, so only the activations
        cross the stages. All batches go through the stages as one pipeline (`_stream`). Collective over this DP
        replica's ranks: each of them passes the same batches."""
        for (targets, payload), outs in self._stream((tokens, packing, (targets, payload))
                                                     for tokens, targets, packing, payload in batches):
            yield payload, (torch.cat([self.token_nll(out, targets[rows].to(self.device)) for rows, out in outs])
                            if self.last_stage else None)

    @torch.no_grad()
    def loglikelihood_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, P]]
                              ) -> Iterator[tuple[P, tuple[torch.Tensor, torch.Tensor] | None]]:
        """Each batch's per-token NLL [B, T] of `targets` after `tokens`, and whether each target is the greedy
        token there (lm-eval's logprob and is_greedy), on the last stage (None on the others), with the batch's
        `payload`, in order; one pipeline over all batches. Collective over this DP replica's ranks."""
        for (targets, payload), outs in self._stream((tokens, None, (targets, payload))
                                                     for tokens, targets, payload in batches):
            if not self.last_stage:
                yield payload, None
                continue
            wanted = [(out, targets[rows].to(self.device)) for rows, out in outs]
            yield payload, (torch.cat([self.token_nll(out, y) for out, y in wanted]),
                            torch.cat([vocab_parallel_argmax(out, self.tp, self.m.vocab_size) == y
                                       for out, y in wanted]))

    @torch.no_grad()
    def next_tokens(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The greedy next token [B] after position `last[b]` of each row of `tokens` [B, T] (right-padded), on
        every rank of this DP replica (one generation step; all of them call it with the same tokens)."""
        [(_, outs)] = self._stream([(tokens, None, None)])  # run to its end: every send completed
        picked = [vocab_parallel_argmax(out[torch.arange(out.shape[0], device=out.device),
                                            last[rows].to(out.device)], self.tp, self.m.vocab_size)
                  for rows, out in outs]
        result = torch.cat(picked) if self.last_stage else torch.empty(tokens.shape[0], dtype=torch.long,
                                                                        device=self.device)
        if self.pp > 1:
            tdist.broadcast(result, src=self._peer[self.pp - 1], group=self.grid.groups.get_pipe_parallel_group())
        return result.cpu()

    def _stream(self, batches: Iterable[tuple[torch.Tensor, Packing | None, P]]
                ) -> Iterator[tuple[P, list[tuple[slice, torch.Tensor]]]]:
        """Each batch's payload with its last stage's logits, chunk by chunk (`windows_per_forward` rows each, as
        (rows, logits); [] on the other stages). The batches' chunks go through the stages as one pipeline: a
        stage starts the next batch while the stages after it finish this one, so the pipeline fills and drains
        once per call, not once per batch (8 batches of 2 windows on 2 stages took 24 chunk-times, now 17).
        Batches are taken one chunk ahead of the forward (`_forwards` posts the next chunk's receive first)."""
        queued: collections.deque[tuple[P, list[slice]]] = collections.deque()

        def chunks() -> Iterator[tuple[torch.Tensor, Packing | None]]:
            for tokens, packing, payload in batches:
                rows = self._chunks(tokens)
                if not rows:
                    raise ValueError("an evaluation batch without rows")
                queued.append((payload, rows))
                for r in rows:
                    yield tokens[r], None if packing is None else (packing[0][r], packing[1][r])

        outputs = self._forwards(chunks())
        for first in outputs:
            payload, rows = queued.popleft()
            outs = [first, *itertools.islice(outputs, len(rows) - 1)]
            yield payload, [(r, out) for r, out in zip(rows, outs, strict=True) if out is not None]

    def _chunks(self, tokens: torch.Tensor) -> list[slice]:
        """The row slices of `tokens` that go through the stages together (`windows_per_forward` rows each)."""
        step = windows_per_forward(tokens.shape[0], self.pp)
        return [slice(i, i + step) for i in range(0, tokens.shape[0], step)]

    def _forwards(self, chunks: Iterable[tuple[torch.Tensor, Packing | None]]) -> Iterator[torch.Tensor | None]:
        """The last stage's logits of each chunk (tokens, packing) in turn (None on the other stages, which pass
        activations on). Pipelined: a stage posts the receive of its next chunk before it computes this one and
        leaves up to `EVALUATION_SENDS_IN_FLIGHT` sends in flight, so neighbouring stages compute different chunks
        at once. With a blocking send and receive per chunk a stage could start a chunk only once its neighbour
        had finished the one before, and each waited on the other. Every send has completed when the loop ends."""
        def receive(tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
            hidden = torch.empty((*tokens.shape, self.m.d_model), device=self.device, dtype=self.dtype)
            return hidden, tdist.irecv(hidden, src=self._peer[self.stage - 1])

        ahead = iter(chunks)
        current = next(ahead, None)
        sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()  # (work, the tensor it sends)
        posted = receive(current[0]) if current is not None and self.stage > 0 else None
        try:
            while current is not None:
                tokens, packing = current
                upcoming = next(ahead, None)
                if posted is None:
                    hidden = tokens.to(self.device)
                else:
                    hidden, work = posted
                    work.wait()
                    posted = receive(upcoming[0]) if upcoming is not None else None
                placed = None if packing is None else (packing[0].to(self.device), packing[1].to(self.device))
                out = self.module(pack(hidden, placed))
                current = upcoming
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
