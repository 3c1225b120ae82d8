"""Packed chat windows -> pipeline micro-batches, and the loss as the mean over the global batch's assistant tokens.

Why a scale travels with the labels: DeepSpeed's pipeline averages the micro-batch losses over the gradient
accumulation steps and the data-parallel ranks. A mean of per-micro-batch means would weight a token by how
many trained tokens happen to share its micro-batch; instead each micro-batch's loss is its NLL sum times
(micro_batches x dp / trained tokens of the global batch), so the engine's average is exactly the global
token-weighted mean, whatever the layout. A plain-text batch (bare labels) keeps the family's own loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tasks.train.data import PackedRows

IGNORE = -100  # a label trained on by nothing (transformers' convention)


def packed_inputs(rows: PackedRows) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((tokens, position_ids, doc_ids), labels) of [n, seq_len + 1] packed windows: labels are the next token
    where it is an assistant token of the same document, else IGNORE."""
    same_doc = rows.doc_ids[:, 1:] == rows.doc_ids[:, :-1]
    labels = rows.tokens[:, 1:].masked_fill(~(rows.mask[:, 1:] & same_doc), IGNORE)
    return (rows.tokens[:, :-1].contiguous(), rows.position_ids[:, :-1].contiguous(),
            rows.doc_ids[:, :-1].contiguous()), labels.contiguous()


def loss_scale(micro_batches: int, dp: int, trained_tokens: int) -> torch.Tensor:
    """What one micro-batch's NLL sum is multiplied by (see the module docstring)."""
    return torch.tensor(micro_batches * dp / max(1, trained_tokens), dtype=torch.float32)


def token_weighted_loss(plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        token_nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """The pipeline's loss_fn: `plain` for bare labels; for (labels, scale) the scaled NLL sum over the
    labels that are not IGNORE (`token_nll`: the family's per-token cross entropy, vocab-parallel where it is),
    plus a mixture of experts' auxiliary loss when the head passes it beside the logits (as `plain` adds it)."""

    def loss_fn(outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                labels: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if not isinstance(labels, tuple):
            return plain(outputs, labels)
        logits, aux = outputs if isinstance(outputs, tuple) else (outputs, None)
        targets, scale = labels
        trained = targets != IGNORE
        nll = token_nll(logits, targets.masked_fill(~trained, 0))
        loss = (nll * trained).sum() * scale
        return loss if aux is None else loss + aux

    return loss_fn
