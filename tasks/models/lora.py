"""LoRA for every family: low-rank adapters on the block linears of a frozen base, sharded like their layer.

Why one mechanism: every family builds its blocks from `nn.Linear`s that are column-parallel (split by
output rows), row-parallel (split by input columns, through `parallel.row_parallel`) or replicated, as its
`shard_spec` says. `apply_lora` wraps the targeted linears of an already built (and loaded) module, the
DeepSpeed `PipelineModule` of a stage or the single-process `Reference` alike, so the adapters live in
their layer's pipeline stage and the reference trains exactly the same maths.

The update is PEFT's: y = W x + b + (alpha / r) * B(A(dropout(x))), A drawn kaiming-uniform (a = sqrt(5), as
peft does) from a generator seeded per tensor, B zeros. Under TP:
- column-parallel: A replicated, B split by output rows; A's gradient is summed over the TP ranks;
- row-parallel: A split by input columns, B replicated; the update joins the base's partial output
  before its one all-reduce, so B's gradient is summed over the TP ranks.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from tasks.base.layout import ORIGIN, Coord, Layout
from tasks.config.model import ModelConfig
from tasks.config.schema import LoraConfig
from tasks.models import get_family
from tasks.models.common.names import BLOCK
from tasks.models.parallel import TPGroup, copy_to_tp, set_slice


def targets(m: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Target module name (the Hugging Face module name PEFT uses: `q_proj`) -> the block-relative linears it
    names (`attn.q`), from the family's full shapes: every 2-D weight of a block is a linear."""
    family = get_family(m.family)
    found: dict[str, list[str]] = {}
    for ref, shape in family.full_shapes(m).items():
        match = BLOCK.fullmatch(ref)
        if match is None or match.group(1) != "0" or len(shape) != 2 or not ref.endswith(".weight"):
            continue
        module = match.group(2).removesuffix(".weight")
        found.setdefault(family.hf_name(ref).removesuffix(".weight").rsplit(".", 1)[-1], []).append(module)
    return {name: tuple(modules) for name, modules in found.items()}



def adapter_params_per_block(m: ModelConfig, lora: LoraConfig, layout: Layout) -> int:
    """Adapter parameters one rank of `layout` holds in one block (the planner's count; every block has the same)."""
    shapes = get_family(m.family).full_shapes(m)
    held = 0
    for rel in target_linears(lora, m):
        out_full, in_full = shapes[f"blocks.0.{rel}.weight"]
        for part, size in (("lora_A", lora.rank * in_full), ("lora_B", out_full * lora.rank)):
            split = adapter_shard_spec(m, f"blocks.0.{rel}.{part}.weight", layout, ORIGIN)
            held += size // layout.tp if split else size
    return held


def target_linears(lora: LoraConfig, m: ModelConfig) -> list[str]:
    """The block-relative linears (`attn.q`) the config's target modules name, sorted."""
    return sorted({rel for name in lora.target_modules for rel in targets(m)[name]})


def adapter_full_shapes(m: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor's reference name and full (unsharded) shape: A [r, in], B [out, r] per target."""
    shapes = get_family(m.family).full_shapes(m)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(m.n_layers):
        for rel in target_linears(lora, m):
            out_full, in_full = shapes[f"blocks.{i}.{rel}.weight"]
            out[f"blocks.{i}.{rel}.lora_A.weight"] = (lora.rank, in_full)
            out[f"blocks.{i}.{rel}.lora_B.weight"] = (out_full, lora.rank)
    return out


def lora_generator(seed: int, ref: str) -> torch.Generator:
    """The generator an adapter's A is drawn from: per (seed, weight name), so every layout draws the same A."""
    return torch.Generator().manual_seed(zlib.crc32(f"lora:{seed}:{ref}".encode()))


class LoRALinear(nn.Module):
    """A frozen linear (its own weight and bias Parameters, so checkpoint names do not change) plus an adapter.

    `split`: how the base weight is split across TP ranks (its shard_spec's dim: 0 column-parallel,
    1 row-parallel, None replicated).
    """

    def __init__(self, base: nn.Linear, ref: str, m: ModelConfig, lora: LoraConfig, tp: TPGroup, seed: int) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.tp, self.scaling = tp, lora.alpha / lora.rank
        spec = get_family(m.family).shard_spec(m, ref, tp.layout, tp.coord) if tp.size > 1 else None
        self.split = None if spec is None else spec[0]
        out_full, in_full = get_family(m.family).full_shapes(m)[ref]
        out_local, in_local = base.weight.shape
        self.lora_A = nn.Linear(in_local, lora.rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(lora.rank, out_local, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.drop = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        module = ref.removesuffix(".weight")
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) of the full [r, in] matrix, as peft
        with torch.no_grad():
            a = torch.empty(lora.rank, in_full).uniform_(-bound, bound, generator=lora_generator(seed, ref))
            for part, full in (("lora_A", a), ("lora_B", torch.zeros(out_full, lora.rank))):
                name = f"{module}.{part}.weight"
                set_slice(getattr(self, part).weight, full.to(base.weight.dtype),
                          adapter_shard_spec(m, name, tp.layout, tp.coord), tp.layout)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B A dropout(x): this rank's output rows (column), its partial sum (row) or all (replicated)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        if self.split == 0:
            a = copy_to_tp(a, self.tp)  # every rank's output rows contribute to the replicated A's gradient
        elif self.split == 1:
            b = copy_to_tp(b, self.tp)  # every rank's input columns contribute to the replicated B's gradient
        return F.linear(F.linear(self.drop(x), a), b) * self.scaling

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Row-parallel: this rank's share of the output before the TP all-reduce (no bias: added after it)."""
        return F.linear(x, self.weight) + self.update(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.update(x)


def apply_lora(module: nn.Module, m: ModelConfig, lora: LoraConfig, tp: TPGroup, seed: int) -> int:
    """Wrap the targeted linears of every block in `module` and freeze everything else; returns how many.

    Call it after the base weights are in place (loaded or drawn) and before the optimizer is built.
    """
    relatives = target_linears(lora, m)
    for p in module.parameters():
        p.requires_grad_(False)
    wrapped = 0
    for layer in [x for x in module.modules() if str(getattr(x, "ref_prefix", "")).startswith("blocks.")]:
        for rel in relatives:
            parent_name, attr = rel.rsplit(".", 1) if "." in rel else ("", rel)
            parent = layer.get_submodule(parent_name)
            ref = f"{layer.ref_prefix}.{rel}.weight"
            parent.add_module(attr, LoRALinear(getattr(parent, attr), ref, m, lora, tp, seed))
            wrapped += 1
    return wrapped


def is_adapter_param(name: str) -> bool:
    """Whether a reference name is an adapter's: `blocks.3.attn.q.lora_A.weight`."""
    return name.rsplit(".", 2)[-2:-1] in (["lora_A"], ["lora_B"])


def adapter_shard_spec(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of an adapter tensor the rank at `coord` holds: a column-parallel linear's B by its output
    rows, a row-parallel linear's A by its input columns (the base weight's own split); the other one replicated."""
    module, part, _ = name.rsplit(".", 2)
    spec = get_family(m.family).shard_spec(m, f"{module}.weight", layout, coord)
    return spec if spec is not None and spec[0] == (1 if part == "lora_A" else 0) else None


def shard_spec(m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
    """The split of any reference name, an adapter's included (readers of checkpoints and weights use it)."""
    split = adapter_shard_spec if is_adapter_param(name) else get_family(m.family).shard_spec
    return split(m, name, layout, coord)


def unshard(m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of any reference name, an adapter's included, from its TP pieces (by TP rank)."""
    if not is_adapter_param(name):
        return get_family(m.family).unshard(m, name, pieces)
    spec = adapter_shard_spec(m, name, Layout(tp=len(pieces)), ORIGIN) if len(pieces) > 1 else None
    return pieces[0] if spec is None else torch.cat(pieces, dim=spec[0])


def merge_layer(lora: LoraConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's tensors (reference names) with each adapted weight replaced by W + (alpha / r) B A
    (in fp32) and the adapter tensors dropped: what the base model holds after `merge_and_unload()`."""
    merged = {}
    for name, tensor in tensors.items():
        if is_adapter_param(name):
            continue
        module = name.removesuffix(".weight")
        a, b = tensors.get(f"{module}.lora_A.weight"), tensors.get(f"{module}.lora_B.weight")
        if a is not None and b is not None:
            delta = (b.float() @ a.float()) * (lora.alpha / lora.rank)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        merged[name] = tensor
    return merged
