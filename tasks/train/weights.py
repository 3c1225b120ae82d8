"""Load and fingerprint consolidated weights (the file publish uploads and evaluate reads).

Why separate from the worker: evaluate, publish and tests need the reference
model from a checkpoint without importing DeepSpeed or starting processes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tasks.config import ModelConfig
from tasks.errors import InvalidInputError
from tasks.train.checkpoint import CONSOLIDATED
from tasks.train.model import GPT


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The consolidated fp32 state dict at `path` (a file, or a checkpoint dir holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / CONSOLIDATED
    if not path.is_file():
        raise InvalidInputError(f"{path}: consolidated weights not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt files
        raise InvalidInputError(f"{path}: unreadable weights: {exc}") from None
    if not isinstance(state, dict):
        raise InvalidInputError(f"{path}: not a state dict")
    return state


def load_reference(path: str | Path, m: ModelConfig) -> GPT:
    """A single-process reference model with the weights at `path`; shapes must match the config."""
    model = GPT(m)
    state = load_state(path)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise InvalidInputError(f"{path}: weights do not match model config (missing {missing[:3]}, extra {extra[:3]})")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise InvalidInputError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, model config needs {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)
    return model


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes in sorted order: equal iff bitwise-equal weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
