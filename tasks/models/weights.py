"""Read model weights tensor by tensor, or one tensor-parallel slice at a time, from any of their forms.

Why one reader for three forms: a training checkpoint (DeepSpeed's per-layer, per-TP-rank files), a
Hugging Face directory (sharded safetensors, ours or an imported model) and a legacy single-file
`consolidated.pt` all hold the same reference tensors. Ranks load starting weights through
`load_into` (each reads only its stage's tensors and only its slice: `safe_open(...).get_slice`), and
so do the evaluation ranks; `load_reference` builds a whole single-process model (tests, benchmarks:
only for models one process holds), and export streams a checkpoint's layers with `CheckpointWeights`.
Nothing here reads a whole model into memory unless asked for the whole model.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import leads_outside
from tasks.base.model_files import (
    CHECKPOINT_BASE_FILE,
    DTYPES,
    HF_CONFIG,
    HF_INDEX,
    HF_SINGLE,
    LEGACY_FILE,
    index_shards,
)
from tasks.config.model import ModelConfig
from tasks.config.schema import LoraConfig
from tasks.models import get_family
from tasks.models import lora as lora_mod
from tasks.models.common.init import no_default_init
from tasks.models.common.moe_sharding import expert_range
from tasks.models.parallel import TPGroup

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
_EXPERT_FILE = re.compile(r"layer_(\d+)-model_(\d+)-experts_(\d+)-model_states\.pt")


def expert_layer_file(layer: int, tp_rank: int, ep_rank: int) -> str:
    """The checkpoint file of one pipeline layer's experts held by one expert-parallel rank's TP rank
    (`parallel.ep` > 1; DeepSpeed's layer file beside it holds the rest: tasks/train/pipeline.py)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-experts_{ep_rank:02d}-model_states.pt"

Slice = tuple[int, int, int] | None  # (dim, start, end) of the full tensor; None = all of it


def local_named_params(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(reference name, local tensor) for every parameter this pipeline rank holds."""
    for child in module.modules():
        prefix = getattr(child, "ref_prefix", None)
        if prefix is None:
            continue
        for name, p in child.named_parameters():
            yield f"{prefix}.{name}", p


def layer_prefix(index: int, n_layers: int) -> str:
    """Reference prefix of PipelineModule layer `index`: [embed, blocks.0 .. blocks.n-1, head]."""
    if index == 0:
        return "embed"
    if index <= n_layers:
        return f"blocks.{index - 1}"
    return "head"


class CheckpointWeights:
    """A committed checkpoint's weights from DeepSpeed's layer files (`layer_LL-model_TT-model_states.pt`,
    one per pipeline layer and TP rank, written by data-parallel rank 0); TP pieces are joined on read, and an
    expert-parallel run's experts (`expert_layer_file`, one per layer, TP rank and expert-parallel rank) after them.
    A LoRA run's checkpoint holds only the adapters: its frozen base tensors are read from the base weights
    its `CHECKPOINT_BASE_FILE` names, so every reader sees the whole model."""

    def __init__(self, directory: str | Path, m: ModelConfig) -> None:
        self.dir, self.m = Path(directory), m
        self.files: dict[int, dict[int, Path]] = {}
        self.expert_files: dict[int, dict[tuple[int, int], Path]] = {}  # layer: {(ep rank, tp rank): file}
        for path in self.dir.iterdir():
            if match := _LAYER_FILE.fullmatch(path.name):
                self.files.setdefault(int(match.group(1)), {})[int(match.group(2))] = path
            elif match := _EXPERT_FILE.fullmatch(path.name):
                layer, tp, ep = (int(g) for g in match.groups())
                self.expert_files.setdefault(layer, {})[ep, tp] = path
        if not self.files:
            raise InvalidInputError(f"{self.dir}: no DeepSpeed layer files (layer_*-model_states.pt) in checkpoint")
        self.layer_of = {f"{layer_prefix(i, m.n_layers)}.": i for i in self.files}
        self._base: Weights | None = None  # opened on the first frozen tensor asked for (never, for the adapters)
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None  # readers go layer by layer

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Full (TP-joined) tensors of one pipeline layer, by reference name (an adapter-only checkpoint's
        frozen ones from its base)."""
        layer = dict(self._saved(index))
        if (self.dir / CHECKPOINT_BASE_FILE).is_file():
            prefix = f"{layer_prefix(index, self.m.n_layers)}."
            for name in get_family(self.m.family).full_shapes(self.m):
                if name.startswith(prefix) and name not in layer:
                    layer[name] = self.base().read(name)
        return layer

    def _saved(self, index: int) -> dict[str, torch.Tensor]:
        """The TP-joined tensors of one pipeline layer that its files hold."""
        if self._cached is None or self._cached[0] != index:
            pieces = {tp: _torch_load(path) for tp, path in sorted(self.files[index].items())}
            prefix = layer_prefix(index, self.m.n_layers)
            names = pieces[min(pieces)].keys()
            joined = {f"{prefix}.{n}": lora_mod.unshard(self.m, f"{prefix}.{n}", [p[n] for p in pieces.values()])
                      for n in names}
            experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # ep rank: {tp rank: tensors}
            for (ep, tp), path in sorted(self.expert_files.get(index, {}).items()):
                experts.setdefault(ep, {})[tp] = _torch_load(path)
            for n in experts[0][0] if experts else ():
                name = f"{prefix}.{n}"
                joined[name] = torch.cat([lora_mod.unshard(self.m, name, [p[n] for _, p in sorted(by_tp.items())])
                                          for _, by_tp in sorted(experts.items())])
            self._cached = (index, joined)
        return self._cached[1]

    def base(self) -> Weights:
        """The base weights an adapter-only checkpoint names in its `CHECKPOINT_BASE_FILE`."""
        if self._base is None:
            path = self.dir / CHECKPOINT_BASE_FILE
            try:
                base = Path(json.loads(path.read_text())["path"])
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidInputError(f"{path}: malformed ({exc})") from None
            if not base.exists():
                raise InvalidInputError(f"{path}: the checkpoint's base weights {base} are not on this machine "
                                        "(the checkpoint holds only the LoRA adapters; fetch the run's starting "
                                        "weights there)")
            self._base = open_weights(base, self.m)
        return self._base

    def layers(self) -> list[int]:
        return sorted(self.files)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for i in self.layers() for n, t in self.layer(i).items()}

    def read(self, name: str, piece: Slice = None) -> torch.Tensor:
        prefix = next((p for p in self.layer_of if name.startswith(p)), None)
        if prefix is None:
            raise InvalidInputError(f"{self.dir}: checkpoint has no tensor {name}")
        saved = self._saved(self.layer_of[prefix])
        if name not in saved and (self.dir / CHECKPOINT_BASE_FILE).is_file():
            return self.base().read(name, piece)  # a frozen tensor, read (and sliced) where the base is
        return _cut(saved[name], piece)


class HFWeights:
    """A Hugging Face directory: config.json + model.safetensors or shards with their index."""

    def __init__(self, directory: str | Path, m: ModelConfig) -> None:
        from safetensors import safe_open

        self.dir, self.family = Path(directory), get_family(m.family)
        index = self.dir / HF_INDEX
        if index.is_file():
            files = index_shards(index.read_bytes(), str(index))
        elif (self.dir / HF_SINGLE).is_file():
            files = [HF_SINGLE]
        else:
            raise InvalidInputError(f"{self.dir}: neither {HF_INDEX} nor {HF_SINGLE}")
        self.handles: dict[str, Any] = {}
        self.where: dict[str, tuple[str, str]] = {}  # reference name -> (file, HF name)
        self.stacked: dict[str, _Stacked] = {}  # a mixture of experts' per-expert layout, stacked on read
        for file in files:
            path = self.dir / file
            if (away := leads_outside(self.dir, file)) is not None:
                raise InvalidInputError(f"{path}: leads outside {self.dir} (to {away}); a model folder's weights "
                                        "lie inside it")
            if not path.is_file():
                raise InvalidInputError(f"{path}: listed in {HF_INDEX} but missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise InvalidInputError(f"{path}: unreadable safetensors file: {exc}") from None
            self.handles[file] = handle
            for hf in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if hf.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed here
                    continue
                if (piece := self.family.expert_piece(hf)) is not None:
                    self.stacked.setdefault(piece[0], _Stacked(piece[0])).add(piece[1], piece[2], handle, file, hf)
                    continue
                try:
                    self.where[self.family.ref_name(hf)] = (file, hf)
                except ValueError as exc:
                    raise InvalidInputError(f"{path}: {exc}") from None

        for ref, stacked in self.stacked.items():
            if ref in self.where:
                raise InvalidInputError(f"{self.dir}: {ref} is held both stacked ({self.where[ref][1]}) and per "
                                        "expert; refused")
            stacked.check(self.dir)

    def tensors(self) -> list[tuple[str, str]]:
        """(file, Hugging Face name) of every tensor read: whole ones and each expert's parts."""
        return [*self.where.values(), *((file, hf) for stacked in self.stacked.values()
                                        for _, file, hf in stacked.parts.values())]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {ref: tuple(self.handles[f].get_slice(hf).get_shape()) for ref, (f, hf) in self.where.items()} | {
            ref: stacked.shape() for ref, stacked in self.stacked.items()}

    def read(self, name: str, piece: Slice = None) -> torch.Tensor:
        if name in self.stacked:
            return self.stacked[name].read(piece)
        file, hf = self.where[name]
        if piece is None:
            return self.handles[file].get_tensor(hf)
        dim, start, end = piece
        return self.handles[file].get_slice(hf)[(slice(None),) * dim + (slice(start, end),)]


class _Stacked:
    """A stacked expert tensor [E, rows, cols] that a checkpoint holds per expert: expert e's rows are its parts
    (gate then up, or down alone), each a 2-D tensor of its own. A slice reads only the pieces it covers."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        # (expert, part) -> (safe_open handle, file, HF name)
        self.parts: dict[tuple[int, int], tuple[Any, str, str]] = {}

    def add(self, expert: int, part: int, handle: Any, file: str, hf: str) -> None:
        self.parts[expert, part] = (handle, file, hf)

    def check(self, where: Path) -> None:
        """Every expert holds every part, and each part has the same shape as the first expert's."""
        experts = 1 + max(e for e, _ in self.parts)
        parts = 1 + max(p for _, p in self.parts)
        for e in range(experts):
            for p in range(parts):
                if (e, p) not in self.parts:
                    raise InvalidInputError(f"{where}: {self.ref} is held per expert but lacks expert {e}'s part "
                                            f"{p} (next to {self.parts[0, 0][2]})")
                if self._shape(e, p) != self._shape(0, p):
                    raise InvalidInputError(f"{where}: {self.parts[e, p][2]} has shape {self._shape(e, p)}, "
                                            f"{self.parts[0, p][2]} {self._shape(0, p)}")
        self.experts, self.rows = experts, [self._shape(0, p)[0] for p in range(parts)]

    def _shape(self, expert: int, part: int) -> tuple[int, ...]:
        handle, _, hf = self.parts[expert, part]
        return tuple(handle.get_slice(hf).get_shape())

    def shape(self) -> tuple[int, ...]:
        return self.experts, sum(self.rows), self._shape(0, 0)[1]

    def read(self, piece: Slice) -> torch.Tensor:
        """The full tensor, or its `piece` (dim 0: experts, 1: rows across the parts, 2: columns)."""
        dim, start, end = piece if piece is not None else (0, 0, self.experts)
        experts = range(start, end) if dim == 0 else range(self.experts)
        rows = (start, end) if dim == 1 else (0, sum(self.rows))
        cols = slice(start, end) if dim == 2 else slice(None)
        out = []
        for e in experts:
            pieces, offset = [], 0
            for p, size in enumerate(self.rows):
                lo, hi = max(rows[0], offset), min(rows[1], offset + size)
                if lo < hi:
                    handle, _, hf = self.parts[e, p]
                    pieces.append(handle.get_slice(hf)[lo - offset:hi - offset, cols])
                offset += size
            out.append(torch.cat(pieces, dim=0))
        return torch.stack(out)


class LegacyWeights:
    """A version published before directories: one torch-saved state dict, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.state = _torch_load(self.path)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.state.items()}

    def read(self, name: str, piece: Slice = None) -> torch.Tensor:
        return _cut(self.state[name], piece)


Weights = CheckpointWeights | HFWeights | LegacyWeights


def open_weights(path: str | Path, m: ModelConfig) -> Weights:
    """The weights at `path`: a checkpoint dir, a Hugging Face dir, or a legacy `consolidated.pt` (or its dir)."""
    path = Path(path)
    if path.is_file():
        return LegacyWeights(path)
    if not path.is_dir():
        raise InvalidInputError(f"{path}: weights not found")
    if (path / HF_CONFIG).is_file():
        return HFWeights(path, m)
    if (path / LEGACY_FILE).is_file():
        return LegacyWeights(path / LEGACY_FILE)
    return CheckpointWeights(path, m)


def check_shapes(path: str | Path, m: ModelConfig, lora: LoraConfig | None = None, *, label: str | None = None) -> None:
    """Refuse weights of another model shape, naming the first mismatched tensor (before any rank starts);
    `lora`: the weights hold these adapters too; `label`: how the error names them (default: `path`)."""
    weights = open_weights(path, m)
    have = weights.shapes()
    expected = get_family(m.family).full_shapes(m) | ({} if lora is None else lora_mod.adapter_full_shapes(m, lora))
    label = label or str(path)
    for name, shape in expected.items():
        if name not in have:
            raise InvalidInputError(f"{label}: starting weights lack tensor {name} (model config needs {shape})")
        if have[name] != shape:
            where = ""
            if isinstance(weights, HFWeights):  # named as the folder names it too
                _, file, hf = weights.stacked[name].parts[0, 0] if name in weights.stacked else (None,
                                                                                                 *weights.where[name])
                where = f" ({file}: tensor {hf}{', per expert' if name in weights.stacked else ''})"
            raise InvalidInputError(f"{label}: starting weights' {name}{where} has shape {have[name]}, "
                                    f"the model config needs {shape}")
    extra = sorted(set(have) - set(expected))
    if extra:
        raise InvalidInputError(f"{label}: starting weights have tensors this model does not: {extra[:3]}")


def _runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous [start, end) runs of sorted indices (a TP slice is one run, GPT's fused QKV three)."""
    runs: list[tuple[int, int]] = []
    for i in indices.tolist():
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def read_slice(weights: Weights, m: ModelConfig, name: str, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of tensor `name`, reading only that slice where the format allows (under expert
    parallelism: its experts, then their TP slice of those)."""
    spec = lora_mod.shard_spec(m, name, tp.layout, tp.coord) if tp.size > 1 else None
    if (experts := expert_range(m, name, tp.layout, tp.coord)) is not None:
        held = weights.read(name, (0, *experts))
        return held if spec is None else held.index_select(spec[0], spec[1])
    if spec is None:
        return weights.read(name)
    dim, indices = spec
    parts = [weights.read(name, (dim, start, end)) for start, end in _runs(indices)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def load_into(module: nn.Module, path: str | Path, m: ModelConfig, tp: TPGroup) -> int:
    """Copy this rank's slice of every parameter it holds from the weights at `path`; returns the count."""
    weights = open_weights(path, m)
    count = 0
    with torch.no_grad():
        for name, param in local_named_params(module):
            param.copy_(read_slice(weights, m, name, tp))
            count += 1
    return count


def load_reference(path: str | Path, m: ModelConfig, *, as_dtype: str | None = None,
                   lora: LoraConfig | None = None) -> nn.Module:
    """A single-process fp32 reference model of the config's family holding the weights at `path`; with
    `as_dtype` ("bf16", "fp32") each weight is first rounded to it, as an export in that dtype stores it;
    `lora`: the weights are a LoRA run's, base and adapters."""
    check_shapes(path, m, lora)
    with no_default_init():  # no draw at all: every weight is loaded next
        model = get_family(m.family).Reference(m, seed=None)
        if lora is not None:
            lora_mod.apply_lora(model, m, lora, TPGroup(), seed=0)  # the adapters are loaded next too
    load_into(model, path, m, TPGroup())
    if as_dtype is not None:
        round_to(model, as_dtype)
    return model


def round_to(module: nn.Module, as_dtype: str) -> None:
    """Round every weight to `as_dtype` ("bf16", "fp32") in place, as an export in that dtype stores it."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(getattr(torch, DTYPES[as_dtype])))


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises several types for corrupt files
        raise InvalidInputError(f"{path}: unreadable weights: {exc}") from None
    if not isinstance(state, dict):
        raise InvalidInputError(f"{path}: not a state dict")
    return state


def _cut(t: torch.Tensor, piece: Slice) -> torch.Tensor:
    if piece is None:
        return t
    dim, start, end = piece
    return t.narrow(dim, start, end - start)


def weights_digest(path: str | Path, m: ModelConfig) -> str:
    """sha256 over every full tensor's name, dtype, shape and bytes, in name order, read one at a time:
    equal iff bitwise-equal weights, whatever the form (checkpoint of any layout, export, legacy file)."""
    weights = open_weights(path, m)
    h = hashlib.sha256()
    for name in sorted(get_family(m.family).full_shapes(m)):
        t = weights.read(name).detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
