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
from tasks.train.model import GPT, TPGroup, full_shapes, local_named_params, shard_spec


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


def open_lazily(path: str | Path) -> dict[str, torch.Tensor]:
    """The consolidated state dict memory-mapped: shapes are known at once, and a rank that copies its
    slice reads only those pages (no rank holds the whole model in RAM)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises several types for corrupt files
        raise InvalidInputError(f"{path}: unreadable weights: {exc}") from None
    if not isinstance(state, dict):
        raise InvalidInputError(f"{path}: not a state dict")
    return state


def check_shapes(path: str | Path, m: ModelConfig) -> None:
    """Refuse starting weights of another model shape, naming the first mismatched tensor (before any rank starts)."""
    state = open_lazily(path)
    expected = full_shapes(m)
    for name, shape in expected.items():
        if name not in state:
            raise InvalidInputError(f"{path}: starting weights lack tensor {name} (model config needs {shape})")
        if tuple(state[name].shape) != shape:
            raise InvalidInputError(f"{path}: starting weights' {name} has shape {tuple(state[name].shape)}, "
                                    f"the model config needs {shape}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise InvalidInputError(f"{path}: starting weights have tensors this model does not: {extra[:3]}")


def load_into(module: torch.nn.Module, path: str | Path, m: ModelConfig, tp: TPGroup) -> int:
    """Copy this rank's slice of every parameter it holds from the weights at `path`; returns the count."""
    state = open_lazily(path)
    count = 0
    with torch.no_grad():
        for name, param in local_named_params(module):
            full = state[name]
            spec = shard_spec(m, name.split(".", 2)[2] if name.startswith("blocks.") else name, tp.rank, tp.size)
            param.copy_(full.index_select(spec[0], spec[1]) if spec is not None and tp.size > 1 else full)
            count += 1
    return count


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes in sorted order: equal iff bitwise-equal weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
