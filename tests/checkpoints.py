"""Checkpoint files as the trainer leaves them, written without training (for publish/evaluate tests)."""

from __future__ import annotations

from pathlib import Path

from tasks.config import ModelConfig


def reference_state(m: ModelConfig, seed: int = 0) -> dict:
    """The seeded initial weights of the config's family, by reference name."""
    from tasks.models import get_family

    return get_family(m.family).Reference(m, seed).state_dict()


def write_layer_files(ckpt: Path, m: ModelConfig, state: dict) -> dict:
    """DeepSpeed's per-layer files (`layer_LL-model_00-model_states.pt`, as tp=1 writes them) holding `state`
    (reference names); returns `state`."""
    import torch

    from tasks.models.weights import layer_prefix

    ckpt.mkdir(parents=True, exist_ok=True)
    for index in range(m.n_layers + 2):
        prefix = layer_prefix(index, m.n_layers) + "."
        layer = {n[len(prefix):]: t.clone() for n, t in state.items() if n.startswith(prefix)}
        torch.save(layer, ckpt / f"layer_{index:02d}-model_00-model_states.pt")
    return state
