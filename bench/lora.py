"""LoRA benchmark: step time and peak memory of LoRA vs full fine-tuning of the same ~100M Llama on CPU, and
our LoRA step vs a plain PyTorch + peft loop, side by side in one run.

Run: `.venv/bin/python bench/lora.py [--steps N] [--layers L] [--d-model D] [--seq S]`.

Ours: the DeepSpeed engine as the ranks run it (tasks.base.spawn, one rank, PipelineModule + ZeRO-1 + telemetry),
full fine-tuning and `train.lora` on the same model, batches and initial weights. Plain: a transformers
LlamaForCausalLM of the same sizes in a loop (forward, backward, clip, AdamW), in full and wrapped by
`peft.get_peft_model` with the same rank, alpha and target modules. fp32, micro-batch 1, one thread each
(our one rank at OMP_NUM_THREADS=1, the plain child at torch.set_num_threads(1): the same cores), every case
in its own process (peak RSS is the process's). The four cases by bench/fair.py's method: in turn, the order
rotated each round, `--repeat` (>= 3) runs each (a sample: one run's median step after warm-up, and its peak
RSS), medians with min, max and the load at each sample, a set spread by more than 1.5x taken again. Prints the
median step time and peak RSS of each case; LoRA should save the gradients and Adam states of the base
(12 B/param here) and some backward time; ours should be within the trainer's 1.15 of plain for the same recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fair import Sample, alternated, median, stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trainer import engine_run, free_port, job, write_dataset

LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
SKIP = 2  # warm-up steps (allocator, first touch)


def model_section(layers: int, d_model: int, seq: int) -> dict:
    heads = d_model // 64
    return {"family": "llama", "vocab_size": 32000, "seq_len": seq, "n_layers": layers, "d_model": d_model,
            "n_heads": heads, "n_kv_heads": heads // 3 or 1, "d_ff": 8 * d_model // 3 // 64 * 64}


def ours(model: dict, steps: int, lora: bool) -> Sample:
    """Our engine's median step and peak RSS (telemetry of the one rank)."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        dataset = write_dataset(root / "data", model["vocab_size"], 200_000)
        train = {"steps": steps, "micro_batch_size": 1, "checkpoint_every": steps, "lr": 1e-4,
                 **({"lora": LORA} if lora else {})}
        rows, _ = engine_run(job(root, model, train, free_port()), dataset)
    return Sample(statistics.median(r["step_s"] for r in rows[SKIP:]), load,
                  extra={"peak_rss_bytes": max(r["peak_mem_bytes"] for r in rows)})


def plain(model: dict, steps: int, lora: bool) -> Sample:
    """The plain loop in a process of its own (its peak RSS is its own)."""
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, __file__, "--plain-child", json.dumps([model, steps, lora])],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return Sample(got["step_s"], load, extra={"peak_rss_bytes": got["peak_rss_bytes"]})


def plain_child(model: dict, steps: int, lora: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.config.model import ModelConfig
    from tasks.models import get_family

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = ModelConfig.model_validate(model)
    hf = {k: v for k, v in get_family(m.family).hf_config(m, dtype="float32").items() if k != "architectures"}
    net = LlamaForCausalLM(LlamaConfig(**hf))
    if lora:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                             target_modules=LORA["target_modules"]))
    trainable = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    tokens = torch.randint(0, m.vocab_size, (1, m.seq_len + 1))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = net(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        times.append(time.perf_counter() - started)
    print(json.dumps({"step_s": statistics.median(times[SKIP:]),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case (at least 3)")
    ap.add_argument("--plain-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_child:
        plain_child(*json.loads(args.plain_child))
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    model = model_section(args.layers, args.d_model, args.seq)
    from tasks.config.model import ModelConfig
    from tasks.models import get_family

    params = get_family("llama").total_params(ModelConfig.model_validate(model))
    got = alternated("lora", {
        "ours full": lambda: ours(model, args.steps, lora=False),
        "ours LoRA": lambda: ours(model, args.steps, lora=True),
        "plain full": lambda: plain(model, args.steps, lora=False),
        "plain+peft LoRA": lambda: plain(model, args.steps, lora=True),
    }, args.repeat)
    rows = {name: {"step_s": median(s), "peak_rss_bytes": median(s, "peak_rss_bytes")} for name, s in got.items()}
    print(f"Llama {params / 1e6:.0f}M (L{args.layers} d{args.d_model} s{args.seq} V32000), LoRA r{LORA['rank']} "
          f"on {','.join(LORA['target_modules'])}, micro-batch 1, {args.steps} steps (median after {SKIP}), "
          f"fp32, 1 thread; medians of {len(got['ours full'])} runs a case")
    print(f"  {'case':<16} {'step ms':>9} {'peak RSS MB':>12}  step s: median (min, max; load)")
    for name, r in rows.items():
        print(f"  {name:<16} {r['step_s'] * 1e3:>9.0f} {r['peak_rss_bytes'] / 1e6:>12.0f}  "
              f"{stats(got[name], fmt='.3f')}")
    print(f"  LoRA/full (ours): step {rows['ours LoRA']['step_s'] / rows['ours full']['step_s']:.2f}, "
          f"RSS {rows['ours LoRA']['peak_rss_bytes'] / rows['ours full']['peak_rss_bytes']:.2f}")
    print(f"  ours/plain+peft (LoRA): step {rows['ours LoRA']['step_s'] / rows['plain+peft LoRA']['step_s']:.2f}, "
          f"RSS {rows['ours LoRA']['peak_rss_bytes'] / rows['plain+peft LoRA']['peak_rss_bytes']:.2f}")


if __name__ == "__main__":
    main()
