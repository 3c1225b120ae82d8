"""A mixture-of-experts training step, ours against plain transformers + torch, and the all-to-all share at ep=2.

Run: `.venv/bin/python bench/moe.py [--layers N] [--d-model D] [--experts E] [--top-k K] [--expert-ffn I] [--seq S]
[--batch B] [--steps K] [--rounds R]`.

1. Step ratio (issue 40, goal <= 1.1x): one Qwen3-MoE (Qwen3-30B-A3B's shape, scaled down: 128 experts, top 8
   there) built by transformers with a seed and saved; ours is the family's `Reference` (the blocks the ranks run)
   holding those weights. One step = forward, cross entropy plus the auxiliary load-balancing loss
   (`router_aux_loss_coef` 0.001, as the config carries it), backward and an AdamW step on one micro-batch, fp32,
   one thread each, in this process: the same core. By bench/fair.py's method: each sample is a fresh model's
   median step over `--steps` steps (after one warm-up), the two sides alternated, >= 3 rounds.
2. The all-to-all share at ep=2: two processes (gloo, one thread each), each holding half of every layer's experts
   (`parallel.ep` = 2, the same `Experts` code the ranks run), train the same model on their own micro-batches;
   every `torch.distributed.all_to_all_single` is timed (the split counts and both directions of the rows, forward
   and backward). Printed: the median step and the share of it in all-to-all (gloo over loopback: on NVLink or
   InfiniBand the share is another). Data-parallel gradient reduction is not part of this step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fair import Sample, alternated, median, stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tasks.base.layout import Layout
from tasks.config.model import ModelConfig
from tasks.models import get_family
from tasks.models.common.moe import make_loss_fn
from tasks.models.parallel import TPGroup
from tasks.models.weights import load_reference

AUX_COEF = 0.001


def save_hf(dest: Path, args: argparse.Namespace) -> ModelConfig:
    """The transformers model, seeded, saved as transformers writes it; our config of it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    heads = max(1, args.d_model // 64)
    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=args.d_model, num_hidden_layers=args.layers,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                            intermediate_size=4 * args.d_model, moe_intermediate_size=args.expert_ffn,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                            router_aux_loss_coef=AUX_COEF, max_position_embeddings=max(128, args.seq))
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(dest)
    doc = json.loads((dest / "config.json").read_text())
    return ModelConfig(**{**get_family("qwen3_moe").model_fields_from_hf(doc), "seq_len": args.seq})


def ours_step(hf_dir: Path, m: ModelConfig, steps: int, batch: int) -> Sample:
    load = os.getloadavg()[0]
    model = load_reference(hf_dir, m).train()
    loss_fn = make_loss_fn(TPGroup())
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=torch.Generator().manual_seed(1))
    return Sample(_median_step(model, lambda: loss_fn(model(tokens[:, :-1]), tokens[:, 1:]), steps), load)


def theirs_step(hf_dir: Path, m: ModelConfig, steps: int, batch: int) -> Sample:
    from transformers import AutoModelForCausalLM

    load = os.getloadavg()[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=torch.Generator().manual_seed(1))

    def loss() -> torch.Tensor:
        out = model(tokens[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, m.vocab_size), tokens[:, 1:].reshape(-1))
        return ce + AUX_COEF * out.aux_loss

    return Sample(_median_step(model, loss, steps), load)


def _median_step(model: torch.nn.Module, loss_of: object, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss_of().backward()  # type: ignore[operator]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step pays one-off allocations
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ep_rank(rank: int, hf_dir: str, m: ModelConfig, steps: int, batch: int, port: int, out: str) -> None:
    """One of the two expert-parallel ranks: its half of the experts, its own tokens; times every all-to-all."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)  # the ranks' comm
    layout = Layout(dp=2, ep=2)
    tp = TPGroup(None, layout, layout.coord(rank), ep_group=tdist.group.WORLD)
    spent = [0.0]
    plain = tdist.all_to_all_single

    def timed(*a: object, **kw: object) -> object:
        started = time.perf_counter()
        try:
            return plain(*a, **kw)  # type: ignore[arg-type]
        finally:
            spent[0] += time.perf_counter() - started

    tdist.all_to_all_single = timed  # type: ignore[assignment]  # what deepspeed.comm calls
    from tasks.models.common.init import no_default_init
    from tasks.models.weights import load_into

    with no_default_init():
        model = get_family("qwen3_moe").Reference(m, seed=None, tp=tp)
    load_into(model, hf_dir, m, tp)
    model.train()
    loss_fn = make_loss_fn(TPGroup())
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps_s, shares = [], []
    for i in range(steps + 1):
        spent[0] = 0.0
        tdist.barrier()
        start = time.perf_counter()
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            elapsed = time.perf_counter() - start
            steps_s.append(elapsed)
            shares.append(spent[0] / elapsed)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"step_s": statistics.median(steps_s),
                                                         "share": statistics.median(shares)}))
    tdist.destroy_process_group()


def ep_share(hf_dir: Path, m: ModelConfig, steps: int, batch: int) -> list[dict[str, float]]:
    from tests.services import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_ep_rank, args=(str(hf_dir), m, steps, batch, free_port(), out), nprocs=2,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        m = save_hf(hf_dir, args)
        got = alternated("moe step", {"ours": lambda: ours_step(hf_dir, m, args.steps, args.batch),
                                      "transformers": lambda: theirs_step(hf_dir, m, args.steps, args.batch)},
                         args.rounds)
        ranks = ep_share(hf_dir, m, args.steps, args.batch)
    family = get_family("qwen3_moe")
    print(f"Qwen3-MoE {args.layers} layers, d_model {args.d_model}, {args.experts} experts top {args.top_k} of width "
          f"{args.expert_ffn}, seq {args.seq}, batch {args.batch}, vocab 32000: {family.total_params(m) / 1e6:.1f}M "
          f"parameters; fp32, one thread a side; median of {len(got['ours'])} rounds x {args.steps} steps")
    print(f"step ours {stats(got['ours'], fmt='.3f')} | transformers {stats(got['transformers'], fmt='.3f')} | "
          f"ratio ours / transformers {median(got['ours']) / median(got['transformers']):.3f} (goal <= 1.1)")
    print("ep=2 (2 processes, gloo, one thread each, half the experts each, their own micro-batch): "
          + "; ".join(f"rank {r}: step {d['step_s']:.3f} s, all-to-all {d['share']:.1%} of it"
                      for r, d in enumerate(ranks)))


if __name__ == "__main__":
    main()
