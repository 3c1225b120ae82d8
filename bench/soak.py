"""Rank memory across saves (issue 38): over a long run that saves often, each rank's RSS must plateau.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py [--size small|300m] [--steps 300] [--every 10]
[--glibc-default]` (BENCH_DIR: where the scratch files go; default the system temp dir).

A fresh run through the launcher (2 ranks, pp=2, ZeRO-1, fp32 on CPU, gloo) of `--steps` steps with a checkpoint
every `--every` (the last two kept); each rank records its RSS after every step (after the save when the step
saves) and the summary carries it (`rss_trace`, tasks/train/memory_trace.py). Printed: the trace, one line per
recorded step with every rank's RSS / anonymous RSS; per rank the ratio RSS at the end / RSS after the first
save (goal <= 1.05), the plateau between steps (the highest RSS recorded in the run's second half), and
`retrainer plan`'s process peak against the rank's high-water mark (`peak_rss_bytes`; on a plateau it is the
steps' own peak; goal within 15%); the median step time (what the allocator setting costs) and the seconds rank 0
waited for a snapshot's write before an optimizer step (telemetry's `snapshot_wait_s`).
`--glibc-default` runs the ranks without the fix (glibc's dynamic mmap threshold, as before issue 38: the
bench drops MALLOC_MMAP_THRESHOLD_ from tasks/launch/torchrun.py's TRAINING_RANK_ENV in its own process), for
the before figure.
Sizes: small = the 45M Llama of tests/plan/test_process_memory.py (seq 64, 2 micro-batches of 2); 300m =
bench/scale.py's Llama (d 1024, 20 layers, vocab 32000, seq 256, 2 micro-batches of 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trainer import free_port, job, write_dataset
from tasks.launch import torchrun

SIZES: dict[str, dict[str, Any]] = {
    "small": {"family": "llama", "vocab_size": 16384, "d_model": 768, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
              "d_ff": 2048, "seq_len": 64},
    "300m": {"family": "llama", "vocab_size": 32000, "d_model": 1024, "n_layers": 20, "n_heads": 16,
             "n_kv_heads": 8, "d_ff": 2816, "seq_len": 256},
}
GIB = 2**30


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10, help="train.checkpoint_every")
    parser.add_argument("--glibc-default", action="store_true",
                        help="ranks without MALLOC_MMAP_THRESHOLD_ (the before figure)")
    args = parser.parse_args()

    from tasks.launch import train
    from tasks.plan import plan

    if args.glibc_default:
        torchrun.TRAINING_RANK_ENV.pop("MALLOC_MMAP_THRESHOLD_", None)
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    model = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="bench-soak-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        dataset = write_dataset(root / "data", model["vocab_size"], 400_000)
        cfg = job(root, model, {"steps": args.steps, "checkpoint_every": args.every, "keep_last": 2,
                                "micro_batch_size": 2, "lr": 1e-4}, free_port())
        cfg = cfg.with_overrides({"parallel.pp": 2, "parallel.micro_batches": 2})
        predicted = plan(cfg, device="cpu")
        print(f"soak: {args.size} llama, {predicted.params_total / 1e6:.0f}M params, {args.steps} steps, a save every "
              f"{args.every}, pp=2 CPU; ranks' MALLOC_MMAP_THRESHOLD_ "
              f"{torchrun.rank_env().get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc dynamic)')}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        summary = train(cfg, dataset)
        rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "telemetry.jsonl").read_text().splitlines()]
        steps_s = [r["step_s"] for r in rows]
        waits_s = [r.get("snapshot_wait_s", 0.0) for r in rows]

    traces: list[list[list[Any]]] = summary["rss_trace"]
    print(f"{'step':>6}  " + "  ".join(f"rank {r} RSS / anon GiB" for r in range(len(traces))))
    for row in zip(*traces, strict=True):
        print(f"{row[0][0]:>6}  " + "  ".join(f"{_gib(rss):>10} / {_gib(anon):<9}" for _, rss, anon in row))
    saves = {s for s in range(1, args.steps + 1) if s % args.every == 0 or s == args.steps}
    for rank, trace in enumerate(traces):
        first = next(p for p in trace if p[0] in saves)  # the first save the trace kept (decimated: maybe not the 1st)
        end = trace[-1]
        plateau = max(rss for step, rss, _ in trace if step > args.steps // 2)
        want = predicted.stages[rank]["process_total"]  # pp=2, dp=1: rank r holds stage r
        peak = summary["peak_rss_bytes"][rank]
        print(f"rank {rank}: RSS end / after the first save (step {first[0]}) {end[1] / first[1]:.3f} (anon "
              f"{end[2] / first[2]:.3f}; goal <= 1.05); between steps: plateau {_gib(plateau)} GiB; peak RSS "
              f"{_gib(peak)} GiB, planned {_gib(want)} GiB, {predicted.stages[rank]['process_phase']} (plan / peak "
              f"{want / peak:.3f}; goal within 15%; process terms "
              f"{', '.join(f'{k} {_gib(v)}' for k, v in predicted.stages[rank]['process'].items())})", flush=True)
    print(f"median step {statistics.median(steps_s):.3f}s (min {min(steps_s):.3f}, max {max(steps_s):.3f}); rank 0 "
          f"waited {sum(waits_s):.2f}s for snapshots to be written (most in a step {max(waits_s):.2f}s); load "
          f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
