"""User metric entry points the evaluation tests name in `evaluate.metrics` (as a user's package would)."""

from __future__ import annotations

from pathlib import Path

import torch

from tasks.train.data import TokenWindows


def token_prob(model, tokenizer, dataset_dir: Path) -> dict[str, float]:
    """Mean probability of the next token over the first 8 held-out windows (a collective call: every rank)."""
    m = model.m
    windows = TokenWindows(dataset_dir, "heldout", m.seq_len, m.vocab_size)
    nll = model.nll(windows.get(list(range(min(8, len(windows))))))
    return {"token_prob": float(torch.exp(-nll.double()).mean())}


def vocab_size(model, tokenizer, dataset_dir: Path) -> dict[str, float]:
    """The tokenizer's vocabulary size (checks the tokenizer reaches the metric)."""
    return {"tokenizer_vocab": float(tokenizer.get_vocab_size()) if tokenizer is not None else -1.0}
