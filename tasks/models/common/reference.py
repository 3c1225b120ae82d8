"""The single-process Reference every family subclasses, and the untied pipeline plan of its layer classes."""

from __future__ import annotations

import torch
from torch import nn

from tasks.config.model import ModelConfig
from tasks.models.common.packing import Packing, pack
from tasks.models.parallel import TPGroup


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

    def forward(self, tokens: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """Logits of [b, t] tokens; `packing`: a packed window's (position_ids, doc_ids) (`common.packing`)."""
        x = self.embed(pack(tokens, packing))
        for block in self.blocks:
            x = block(x)
        x = self.head(x)
        return tied_logits(self.embed, x) if self.tied else x


def tied_logits(embed: nn.Module,
                x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The logits through the tied embedding (the last stage's TiedLayerSpec forward_fn); a tuple's first tensor
    (what else the head passes on, a mixture of experts' auxiliary loss, goes along)."""
    if isinstance(x, tuple):
        return (embed.logits(x[0]), *x[1:])
    return embed.logits(x)
