"""Parts every family shares: per-layer init generators, skipped default init, block-name parsing, the
single-process Reference."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from tasks.config.schema import ModelConfig
from tasks.models.parallel import TPGroup

BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


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


def relative(name: str) -> str:
    """A block parameter's name inside its block (`blocks.3.attn.o.weight` -> `attn.o.weight`); others as they are."""
    match = BLOCK.fullmatch(name)
    return match.group(2) if match else name


def pipeline_specs(reference: type[Reference], m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
    """DeepSpeed LayerSpecs [Embedding, n_layers x TransformerBlock, Head] of an untied family's layer classes."""
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(reference.Embedding, m, seed, tp),
        *(LayerSpec(reference.TransformerBlock, m, i, seed, tp) for i in range(m.n_layers)),
        LayerSpec(reference.Head, m, seed, tp),
    ]


class Reference(nn.Module):
    """The whole model in one module: the yardstick; its state-dict names are the reference names.

    A family subclasses it naming its three layer classes; with `tied`, the logits go through the
    embedding's `logits`.
    """

    Embedding: type[nn.Module]
    TransformerBlock: type[nn.Module]
    Head: type[nn.Module]
    can_tie = True  # the family honours model.tie_embeddings

    def __init__(self, m: ModelConfig, seed: int | None = 0, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed = self.Embedding(m, seed, tp)  # attribute names = the reference prefixes (family.EMBED/HEAD)
        self.blocks = nn.ModuleList(self.TransformerBlock(m, i, seed, tp) for i in range(m.n_layers))
        self.head = self.Head(m, seed, tp)
        self.tied = self.can_tie and m.tie_embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.head(x)
        return self.embed.logits(x) if self.tied else x
