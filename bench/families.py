"""Training step time per model family against the same-size Llama, on CPU, side by side in one run.

Run: `.venv/bin/python bench/families.py [--layers N] [--d-model D] [--seq S] [--window W] [--steps K]`.

Every family's model is built from the blocks the ranks run (the family's `Reference`: its embedding,
transformer blocks and head) at the same sizes; one step = forward, cross entropy, backward and an AdamW
step on one micro-batch, fp32, one thread per process as the ranks run on CPU. Families whose maths adds
work (QK-norm, four norms, soft-capping's explicit attention) should cost a little more than Llama; a
family that costs much more has a bug of the kind this exists to show (a mask built per step, a copy per
layer). Sliding-window families run with a window below the sequence length, so the window is exercised.
Every family runs in this process on one thread, Llama too: the same cores. By bench/fair.py's method: one
sample per family and round = a fresh model's median step over `--steps` steps; the families taken in turn, the
order rotated each round, `--rounds` (>= 3) rounds; a set where any family spreads by more than 1.5x is taken
again. Prints each family's median with min, max and the load at each sample, and its ratio to Llama.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from fair import Sample, alternated, median, stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from tasks.config.model import ModelConfig
from tasks.models import get_family


def configs(layers: int, d_model: int, seq: int, window: int) -> dict[str, ModelConfig]:
    heads = max(1, d_model // 64)
    sizes = dict(vocab_size=32000, seq_len=seq, n_layers=layers, d_model=d_model, n_heads=heads,
                 n_kv_heads=max(1, heads // 2), d_ff=4 * d_model, tie_embeddings=True)  # same size everywhere
    return {
        "llama": ModelConfig(family="llama", **sizes),
        "qwen3": ModelConfig(family="qwen3", qk_norm=True, **sizes),
        "mistral": ModelConfig(family="mistral", sliding_window=window, **sizes),
        "gemma3": ModelConfig(family="gemma3", qk_norm=True, sliding_window=window,
                              sliding_window_pattern=2, query_pre_attn_scalar=64, rope_local_base_freq=1e4,
                              **sizes),
        "gemma2": ModelConfig(family="gemma2", sliding_window=window, sliding_window_pattern=2,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **sizes),
    }


def step_seconds(m: ModelConfig, steps: int, batch: int) -> Sample:
    """Median seconds of one training step (after one warm-up step); the load when the model was built."""
    load = os.getloadavg()[0]
    torch.manual_seed(0)
    model = get_family(m.family).Reference(m, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step pays one-off allocations
            times.append(time.perf_counter() - start)
    return Sample(statistics.median(times), load)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = configs(args.layers, args.d_model, args.seq, args.window)
    # families interleaved, so load on the box hits each alike
    results = alternated("families", {name: lambda m=m: step_seconds(m, args.steps, args.batch)
                                      for name, m in cases.items()}, args.rounds)
    base = median(results["llama"])
    print(f"{args.layers} layers, d_model {args.d_model}, seq {args.seq}, window {args.window}, batch {args.batch}, "
          f"vocab 32000; median of {len(results['llama'])} rounds x {args.steps} steps")
    print(f"{'family':<10} {'params (M)':>11} {'step s':>8} {'vs llama':>9}  step s: median (min, max; load)")
    for name, m in cases.items():
        params = get_family(m.family).total_params(m) / 1e6
        t = median(results[name])
        print(f"{name:<10} {params:>11.1f} {t:>8.3f} {t / base:>8.2f}x  {stats(results[name], fmt='.3f')}")


if __name__ == "__main__":
    main()
