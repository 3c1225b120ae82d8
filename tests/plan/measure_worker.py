"""torchrun worker: one real DeepSpeed step of our GPT; report what each rank holds and sends.

Launched by tests/plan/test_measured.py and bench/planner.py (gloo, CPU). Each rank
writes `<out>/rank<R>.json` with the bytes of parameters, gradients and optimizer
states it holds (unique tensor storage, counted at the optimizer step, where
gradients and states coexist) and the bytes it handed to each collective, grouped
by process group (data-parallel, tensor-parallel, other).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

COLLECTIVES = [
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast", "all_reduce_coalesced",
    "all_to_all_single", "send", "recv", "isend", "irecv",
]
CALLS: list[dict[str, Any]] = []
PHASE = {"name": "init"}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


def _wrap(name: str) -> None:
    """Count the bytes of the input tensor(s) of every call; the real collective still runs."""
    real = getattr(tdist, name)

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if group is None and name in ("all_reduce", "reduce", "broadcast") and len(args) >= 3:
            group = args[2] if name != "all_reduce" else (args[2] if len(args) > 2 else None)
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single"):
            payload = args[1] if len(args) > 1 else kwargs.get("input")
        elif name == "reduce_scatter":
            payload = args[1] if len(args) > 1 else kwargs.get("input_list")
        elif name in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
            payload = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("tensor"))
        else:
            payload = args[0] if args else kwargs.get("tensor", kwargs.get("tensors"))
        ranks = tdist.get_process_group_ranks(group) if group is not None else list(range(tdist.get_world_size()))
        CALLS.append({"op": name, "bytes": _nbytes(payload), "ranks": ranks, "phase": PHASE["name"]})
        return real(*args, **kwargs)

    setattr(tdist, name, counted)


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    for k in ("tp", "pp", "dp", "zero", "micro_batches", "mbs", "layers", "d_model", "heads", "kv_heads", "ffn",
              "vocab", "seq"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank on every linear")
    a = ap.parse_args()
    for name in COLLECTIVES:
        if hasattr(tdist, name):
            _wrap(name)

    import deepspeed
    from deepspeed.pipe import PipelineModule

    from tasks.base.comm_ops import load_shm_op
    from tasks.base.layout import Layout
    from tasks.config.model import ModelConfig
    from tasks.models.gpt.model import lm_loss, pipeline_layers
    from tasks.models.grid import build_grid
    from tasks.models.shapes import TRAINING_PARTITION

    torch.manual_seed(0)
    load_shm_op()  # as a rank does: the venv's prebuilt op, never a fresh build in the user's cache
    deepspeed.init_distributed(dist_backend="gloo")
    rank = tdist.get_rank()
    m = ModelConfig(family="gpt",
                    vocab_size=a.vocab, seq_len=a.seq, n_layers=a.layers, d_model=a.d_model, n_heads=a.heads,
                    n_kv_heads=a.kv_heads, d_ff=a.ffn, dropout=0.0)
    grid = build_grid(Layout(tp=a.tp, pp=a.pp, dp=a.dp))
    tp = grid.tp
    module = PipelineModule(layers=pipeline_layers(m, 1234, tp), topology=grid.topology, loss_fn=lm_loss,
                            partition_method=TRAINING_PARTITION, activation_checkpoint_interval=0)
    if a.lora_rank:
        from tasks.config.schema import LoraConfig
        from tasks.models.lora import apply_lora

        lora = LoraConfig(rank=a.lora_rank, alpha=16, target_modules=("qkv", "out", "fc1", "fc2"))
        apply_lora(module, m, lora, tp, 1234)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    ds_config = {
        "train_micro_batch_size_per_gpu": a.mbs,
        "gradient_accumulation_steps": a.micro_batches,
        "zero_optimization": {"stage": a.zero},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)

    inner = optimizer
    outer = engine.optimizer
    snap: dict[str, Any] = {}
    model_params = list(module.parameters())

    def held() -> dict[str, int]:
        weights = _unique_bytes(model_params)
        inner_params = [p for g in inner.param_groups for p in g["params"]]
        weight_keys = {(p.untyped_storage().data_ptr(), p.storage_offset()) for p in model_params}
        master = [p for p in inner_params if (p.untyped_storage().data_ptr(), p.storage_offset()) not in weight_keys]
        grads = [p.grad for p in model_params + inner_params if p.grad is not None]
        for attr in ("averaged_gradients", "ipg_buffer"):
            grads += _tensors(getattr(outer, attr, None))
        optim = _tensors(list(inner.state.values())) + master
        return {"weights": weights, "gradients": _unique_bytes(grads), "optimizer_states": _unique_bytes(optim)}

    def post_hook(*_: Any) -> None:
        snap["at_inner_step"] = held()

    inner.register_step_post_hook(post_hook)
    if outer is not inner:
        real_step = outer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            snap["before_step"] = held()
            return real_step(*args, **kwargs)

        outer.step = step

    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            x = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=gen)
            yield x[:, :-1], x[:, 1:]

    real_reduce = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        snap["after_backward"] = held()  # every gradient produced, none reduced or freed yet
        return real_reduce(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients
    PHASE["name"] = "step"
    engine.train_batch(data_iter=batches())
    PHASE["name"] = "done"
    dp_ranks = tdist.get_process_group_ranks(grid.groups.get_data_parallel_group())
    tp_ranks = tdist.get_process_group_ranks(grid.groups.get_slice_parallel_group())

    def kind(ranks: list[int]) -> str:
        if len(ranks) > 1 and sorted(ranks) == sorted(dp_ranks):
            return "dp"
        if len(ranks) > 1 and sorted(ranks) == sorted(tp_ranks):
            return "tp"
        return "other"

    comm: dict[str, dict[str, int]] = {}
    for c in CALLS:
        if c["phase"] != "step":
            continue
        bucket = comm.setdefault(kind(c["ranks"]), {})
        bucket[c["op"]] = bucket.get(c["op"], 0) + c["bytes"]
    report = {
        "rank": rank,
        "stage": grid.coord.pp,
        "tp_rank": grid.coord.tp,
        "dp_rank": grid.coord.dp,
        "params": sum(p.numel() for p in model_params),
        "memory": snap,
        "comm": comm,
        "dp_ranks": dp_ranks,
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
