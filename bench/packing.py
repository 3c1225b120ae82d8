"""Packed conversations against plain windows (issue 41): real tokens per second, and packed efficiency.

Run: `.venv/bin/python bench/packing.py [--layers N] [--d-model D] [--seq S] [--batch B] [--steps K]`.

Throughput. One training step (forward, the trainer's loss, backward, AdamW) of the Llama blocks the ranks run
(the family's `Reference`), fp32, one thread, on two batches of `--batch` windows of `--seq` tokens: packed
conversations (positions restarting per document, the block-causal mask, labels only on assistant tokens, the
token-weighted loss of tasks/train/packing.py), and plain token windows (causal attention, every label).
Printed: the packing's own cost (the plain step over the packed step, the same window tokens; goal >= 0.9),
and real (non-padding) tokens per second, which the padding of the windows lowers too.
The two sides alternate (bench/fair.py: >= 3 rounds, rotated, medians; a scattered set is taken again).

Efficiency. The share of window tokens that are real when whole conversations are packed best-fit decreasing
(tasks/data/packing.py `pack_windows`, what a chat dataset's windows are; beside it, greedily in order, the packer
before), for conversation lengths drawn from a log-normal (median `--median-len` tokens, sigma 1.0: many short
exchanges, a long tail of long ones), cut at the window as `prepare-data --overlong drop` does. Goal: >= 0.9.
Counts, and the seconds the packer takes for a million conversations (every rank packs its split at start).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

from fair import Sample, alternated, median, stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os

import numpy as np
import torch

from tasks.config.model import ModelConfig
from tasks.data.packing import pack_windows
from tasks.models import get_family
from tasks.models.parallel import TPGroup
from tasks.train.packing import IGNORE, token_weighted_loss


def conversation_lengths(n: int, median_len: int, seq: int, seed: int = 0) -> np.ndarray:
    """`n` conversation lengths (tokens), log-normal around `median_len`; longer than a window: dropped."""
    lengths = np.random.default_rng(seed).lognormal(np.log(median_len), 1.0, n).astype(np.int64) + 8
    return lengths[lengths <= seq + 1]


def packed_efficiency(lengths: np.ndarray, seq: int) -> float:
    """Real tokens / window tokens of the windows `pack_windows` makes of these conversations."""
    windows = len(pack_windows(lengths, seq + 1)[1]) - 1
    return float(lengths.sum()) / (windows * (seq + 1))


def in_order_efficiency(lengths: np.ndarray, seq: int) -> float:
    """The same for whole conversations packed greedily in order (the packer before best-fit)."""
    windows, used = 1, 0
    for n in lengths.tolist():
        if used + n > seq + 1:
            windows, used = windows + 1, 0
        used += n
    return float(lengths.sum()) / (windows * (seq + 1))


def packed_batch(lengths: np.ndarray, batch: int, seq: int, vocab: int) -> tuple[tuple[torch.Tensor, ...],
                                                                                  torch.Tensor, int]:
    """((tokens, position_ids, doc_ids), labels, real tokens) of the first `batch` packed windows: random tokens,
    the second half of each conversation the assistant's."""
    members, bounds = pack_windows(lengths, seq + 1)
    windows = [members[a:b] for a, b in itertools.pairwise(bounds[:batch + 1].tolist())]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.zeros(batch, seq + 1, dtype=torch.int64)
    positions, docs = torch.zeros_like(tokens), torch.zeros_like(tokens)
    labels = torch.full((batch, seq), IGNORE, dtype=torch.int64)
    real = 0
    for row, members in enumerate(windows):
        sizes = lengths[members].tolist()
        bounds = [*itertools.accumulate(sizes, initial=0), seq + 1]
        used = bounds[-2]
        tokens[row, :used] = torch.randint(0, vocab, (used,), generator=gen)
        for doc, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            docs[row, lo:hi], positions[row, lo:hi] = doc, torch.arange(hi - lo)
            if hi <= used:  # a conversation, not the padding: its second half is trained on
                mid = (lo + hi) // 2
                labels[row, mid:hi - 1] = tokens[row, mid + 1:hi]
        real += used
    return (tokens[:, :-1], positions[:, :-1], docs[:, :-1]), labels, real


def packing_seconds(lengths: np.ndarray, seq: int) -> float:
    """Seconds `pack_windows` takes for these conversations (the index every rank builds at start)."""
    start = time.perf_counter()
    pack_windows(lengths, seq + 1)
    return time.perf_counter() - start


def step_seconds(m: ModelConfig, inputs: object, labels: object, steps: int) -> Sample:
    """Median seconds of one training step on these inputs (after a warm-up step)."""
    load = os.getloadavg()[0]
    torch.manual_seed(0)
    family = get_family(m.family)
    model = family.Reference(m, seed=0)
    loss_fn = token_weighted_loss(family.make_loss_fn(TPGroup()), family.make_token_nll_fn(TPGroup()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss_fn(model(inputs), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return Sample(statistics.median(times), load)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--median-len", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    heads = max(1, args.d_model // 64)
    m = ModelConfig(family="llama", vocab_size=32000, seq_len=args.seq, n_layers=args.layers, d_model=args.d_model,
                    n_heads=heads, n_kv_heads=max(1, heads // 2), d_ff=4 * args.d_model)
    lengths = conversation_lengths(20000, args.median_len, args.seq)
    for seq in sorted({args.seq, 2048, 4096}):
        kept = conversation_lengths(20000, args.median_len, seq)
        print(f"packed efficiency, seq {seq}: {packed_efficiency(kept, seq):.3f} best-fit (goal >= 0.9), "
              f"{in_order_efficiency(kept, seq):.3f} in order ({len(kept)} conversations, median "
              f"{int(np.median(kept))} tokens)")
    many = conversation_lengths(1_000_000, args.median_len, 4096)
    print(f"packing {len(many)} conversations into windows of 4097: {packing_seconds(many, 4096):.2f} s")
    inputs, labels, real = packed_batch(lengths, args.batch, args.seq, m.vocab_size)
    scale = torch.tensor(1.0 / max(1, int((labels != IGNORE).sum())))
    plain = torch.randint(0, m.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(2))
    got = alternated("packing", {
        "packed": lambda: step_seconds(m, inputs, (labels, scale), args.steps),
        "plain": lambda: step_seconds(m, plain[:, :-1], plain[:, 1:], args.steps),
    }, args.rounds)
    packed_rate = real / median(got["packed"])
    plain_rate = args.batch * args.seq / median(got["plain"])
    print(f"{args.layers} layers, d_model {args.d_model}, {args.batch} windows of {args.seq}; "
          f"{real} real tokens in the packed batch ({real / (args.batch * (args.seq + 1)):.3f} of its windows)")
    print(f"packed step {stats(got['packed'], fmt='.3f')} | plain step {stats(got['plain'], fmt='.3f')}")
    print(f"the packing itself (positions, block-causal mask, token-weighted loss), same window tokens: plain step / "
          f"packed step {median(got['plain']) / median(got['packed']):.3f} (goal >= 0.9)")
    print(f"real tokens/s: packed {packed_rate:.0f}, plain {plain_rate:.0f}: {packed_rate / plain_rate:.3f} "
          "(the packing and this batch's padding together)")


if __name__ == "__main__":
    main()
