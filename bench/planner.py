"""Planner benchmark: predicted vs measured memory per rank, next to DeepSpeed's own estimator.

CPU (always): for several (tp, pp, dp, ZeRO) layouts of our GPT, one real DeepSpeed
step under tasks.base.spawn (gloo); model-state bytes (weights + gradients at their peak +
optimizer states) counted per rank, vs the planner and vs DeepSpeed's
`estimate_zero2_model_states_mem_needs` (the peer: the only up-front estimator a
DeepSpeed user has; it knows neither TP/PP nor activations). Plus activations:
bytes autograd saves for backward in one forward (saved-tensor hooks) vs the plan.
GPU (when one is present): torch.cuda.max_memory_allocated for a ~1B model in
bf16 with DeepSpeed, in a few single-GPU layouts, vs the plan's total.

    .venv/bin/python bench/planner.py            # prints markdown tables
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.plan import plan  # noqa: E402
from tests.plan.conftest import make_config  # noqa: E402
from tests.plan.test_measured import MODEL, run_layout  # noqa: E402

CPU_LAYOUTS = {
    "dp2 zero0 m2": {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0, "micro_batches": 2},
    "dp2 zero1": {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1, "micro_batches": 1},
    "tp2 zero0": {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 0, "micro_batches": 1},
    "pp2 dp2 zero1 m2": {"tp": 1, "pp": 2, "dp": 2, "zero_stage": 1, "micro_batches": 2},
}
BENCH_MODEL = {**MODEL, "n_layers": 4, "d_model": 64, "d_ff": 256, "vocab_size": 256, "seq_len": 32}


def _ds_estimate(total_params: int, gpus: int) -> int:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=gpus, cpu_offload=False)[1]


def cpu_model_states() -> list[str]:
    rows = ["| layout | rank (stage) | measured W+G+O | planner | planner/measured | DeepSpeed est. | DS/measured |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name, layout in CPU_LAYOUTS.items():
        cfg = make_config(model=BENCH_MODEL, parallel=layout,
                          train={"precision": "fp32", "micro_batch_size": 2, "grad_clip": 0.0})
        predicted = plan(cfg)
        world = layout["tp"] * layout["pp"] * layout["dp"]
        with tempfile.TemporaryDirectory() as tmp:
            reports = run_layout(layout, Path(tmp), mbs=2, model=BENCH_MODEL)
        peer = _ds_estimate(predicted.params_total, world)
        for r in reports:
            if r["dp_rank"] != 0 or r["tp_rank"] != 0:
                continue  # identical to their DP/TP peers
            mem = r["memory"]
            measured = (mem["at_inner_step"]["weights"] + mem["after_backward"]["gradients"]
                        + mem["at_inner_step"]["optimizer_states"])
            st = predicted.stages[r["stage"]]
            ours = st["weights"] + st["gradients"] + st["optimizer_states"]
            rows.append(f"| {name} | {r['rank']} ({r['stage']}) | {measured:,} | {ours:,} | {ours / measured:.3f} "
                        f"| {peer:,} | {peer / measured:.3f} |")
    return rows


def cpu_activations() -> list[str]:
    import torch

    from tasks.models.gpt.model import Reference as GPT
    from tasks.models.gpt.model import lm_loss

    rows = ["| model (fp32, SDPA) | mbs x seq | measured saved | planner | planner/measured |",
            "|---|---|---:|---:|---:|"]
    shapes = [
        ("L4 d64 h4 V256", {**BENCH_MODEL}, 4),
        ("L4 d128 h8 V512 s128", {**BENCH_MODEL, "d_model": 128, "n_heads": 8, "n_kv_heads": 8, "d_ff": 512,
                                  "vocab_size": 512, "seq_len": 128}, 4),
        ("L2 d256 h4 kv2 V1024 s64", {**BENCH_MODEL, "n_layers": 2, "d_model": 256, "n_heads": 4, "n_kv_heads": 2,
                                      "d_ff": 1024, "vocab_size": 1024, "seq_len": 64}, 8),
    ]
    for name, model, mbs in shapes:
        cfg = make_config(model=model, train={"precision": "fp32", "micro_batch_size": mbs})
        net = GPT(cfg.model).train()
        params = {p.untyped_storage().data_ptr() for p in net.parameters()}
        seen: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor, params: set[int] = params, seen: dict = seen) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and t.numel() > 1:  # weights are not activations
                seen[(ptr, t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, cfg.model.vocab_size, (mbs, cfg.model.seq_len + 1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(net(tokens[:, :-1]), tokens[:, 1:])
        measured = sum(seen.values())
        loss.backward()
        ours = plan(cfg).memory.activations_without_recompute
        rows.append(f"| {name} | {mbs} x {cfg.model.seq_len} | {measured:,} | {ours:,} | {ours / measured:.3f} |")
    return rows


def gpu_peak() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return ["GPU peak memory: not measured: no GPU lent"]
    import deepspeed

    from tasks.models.gpt.model import Reference as GPT
    from tasks.models.gpt.model import lm_loss

    one_b = {"family": "gpt", "vocab_size": 32000, "seq_len": 1024, "n_layers": 16, "d_model": 2048, "n_heads": 16,
             "n_kv_heads": 16, "d_ff": 8192, "dropout": 0.0}
    rows = ["| ~1B layout (1 GPU, bf16) | max_memory_allocated | planner total | planner/measured |",
            "|---|---:|---:|---:|"]
    deepspeed.init_distributed(dist_backend="nccl")
    for name, mbs, ckpt, zero in (("zero0 mbs4", 4, False, 0), ("zero1 mbs8 recompute", 8, True, 1),
                                  ("zero1 mbs2", 2, False, 1)):
        cfg = make_config(model=one_b, parallel={"zero_stage": zero},
                          train={"precision": "bf16", "micro_batch_size": mbs, "activation_checkpointing": ckpt})
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        net = GPT(cfg.model)
        if ckpt:
            for blk in net.blocks:
                blk.forward = _checkpointed(blk.forward)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": zero}, "steps_per_print": 10**9})
        tokens = torch.randint(0, 32000, (mbs, 1025), device="cuda")
        for _ in range(2):
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        measured = torch.cuda.max_memory_allocated()
        ours = plan(cfg, device="gpu").memory.total
        rows.append(f"| {name} | {measured:,} | {ours:,} | {ours / measured:.3f} |")
        del engine, net, opt
    return rows


def _checkpointed(fn):
    import torch.utils.checkpoint as cp

    return lambda x: cp.checkpoint(fn, x, use_reentrant=False)


def main() -> None:
    print("## Model states per rank (CPU, fp32, one real DeepSpeed step)\n")
    print("\n".join(cpu_model_states()))
    print("\n## Activations saved for backward (CPU, fp32, one forward)\n")
    print("\n".join(cpu_activations()))
    print("\n## GPU peak memory\n")
    print("\n".join(gpu_peak()))


if __name__ == "__main__":
    main()
