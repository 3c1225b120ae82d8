"""Packed windows: several documents in one sequence, each attending only within itself, its positions from 0.

Why a plain tuple: a DeepSpeed pipeline stage passes one tensor or a tuple of tensors to the next stage, so a
packed micro-batch travels as (activations, position_ids, doc_ids) through every stage (integer tensors get
no gradient and send none back); an unpacked one stays a bare tensor, on exactly the code path it always took.
`position_ids` [b, t] restart at 0 at each document start; `doc_ids` [b, t] number the documents of a window.
"""

from __future__ import annotations

import functools

import torch

Packing = tuple[torch.Tensor, torch.Tensor]  # (position_ids, doc_ids), both [b, t] int64


def unpack(inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Packing | None]:
    """(activations or tokens, packing or None) of what a layer receives."""
    if isinstance(inputs, tuple):
        return inputs[0], (inputs[1], inputs[2])
    return inputs, None


def pack(x: torch.Tensor, packing: Packing | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """What a layer passes on: `x` alone, or with the packing it received."""
    return x if packing is None else (x, *packing)


def document_mask(packing: Packing) -> torch.Tensor | None:
    """[b, 1, t, t] boolean SDPA mask (True = attend): causal and within the query's document; None when every
    window holds one document (plain causal attention is then the same and needs no [t, t] tensor).

    Built once per micro-batch and stage, not per layer: every block of a stage receives the same doc_ids
    tensor object, which keys the cache (by identity; the cache holds it, so its id is not reused)."""
    return _document_mask(packing[1])


@functools.lru_cache(maxsize=2)
def _document_mask(docs: torch.Tensor) -> torch.Tensor | None:
    if bool((docs == docs[:, :1]).all()):
        return None
    t = docs.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=docs.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]
