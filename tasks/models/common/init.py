"""How every family's layers get their initial weights: one seeded generator per layer, torch's default
random init skipped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """The generator a layer draws its initial weights from: layer 0 = embedding, 1..n = blocks, n+1 = head.

    Any (tp, pp, dp) layout builds each layer from the same stream, so it starts from the same weights.
    """
    return torch.Generator().manual_seed(seed * 100_003 + layer)


# torch's random default initialisers (nn.Linear, nn.Embedding, ...); the constant ones (ones_, zeros_) stay.
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def no_default_init() -> Iterator[None]:
    """Build layers without torch's random default initialisation.

    Why: every family fills each of its parameters itself, from its per-layer generator (a fresh run) or
    from the weights loaded next (starting weights, a resume), so torch's default draw is thrown away
    (issue 27: ~7% of a rank's start at 300M, minutes of random numbers at 70B). Only the random
    initialisers are skipped, so a fresh model is bit-identical to one built without this; the global
    RNG is not advanced by the skipped draws (callers reseed before training).
    """
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in _RANDOM_INITS:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
