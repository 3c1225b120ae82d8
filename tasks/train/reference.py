"""A plain single-process PyTorch training loop over the same model, data and optimizer.

Why: it is the yardstick. The 3D-equality tests compare the DeepSpeed engine's
losses against it, and `bench/trainer.py` compares step times with it. It uses
the same initial weights (seeded per layer), the same global batches (the
`Sampler`; a mixture of experts' auxiliary loss taken per micro-batch, as the ranks take it), AdamW, the
warmup-cosine schedule and gradient-norm clipping (with train.lora: the same adapters on a frozen base).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.config.schema import JobConfig
from tasks.models import get_family
from tasks.models.lora import apply_lora
from tasks.models.parallel import TPGroup
from tasks.train.data import Sampler, TokenWindows, split_inputs
from tasks.train.worker import WarmupCosine


@dataclass
class ReferenceRun:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping, as DeepSpeed reports its global norm
    step_seconds: list[float] = field(default_factory=list)
    model: torch.nn.Module | None = None


def train_reference(cfg: JobConfig, dataset_dir: str | Path, steps: int | None = None,
                    start: torch.nn.Module | None = None) -> ReferenceRun:
    """Train the family's reference model on the full global batch of each step (fp32, one process).

    `start`: the family's Reference holding the starting weights (an imported model); None = drawn from
    train.seed, as a scratch run draws them."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    windows = TokenWindows(dataset_dir, "train", m.seq_len, m.vocab_size)
    sampler = Sampler(len(windows), t.micro_batch_size, p.micro_batches, p.dp, t.seed)
    family = get_family(m.family)
    model = start if start is not None else family.Reference(m, t.seed)
    if t.lora is not None:
        apply_lora(model, m, t.lora, TPGroup(), t.seed)
    trainable = [q for q in model.parameters() if q.requires_grad]
    lm_loss = family.make_loss_fn(TPGroup())
    model.train()
    opt = torch.optim.AdamW(trainable, lr=t.lr, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(t.warmup_steps, t.steps))
    run = ReferenceRun(model=model)
    for step0 in range(steps or t.steps):
        x, y = split_inputs(windows.get(sampler.global_indices(step0)))
        started = time.perf_counter()
        if m.router_aux_loss_coef > 0:  # an auxiliary loss per forward, as each rank's micro-batch takes it
            loss = torch.stack([lm_loss(model(xs), ys) for xs, ys in zip(x.split(t.micro_batch_size),
                                                                        y.split(t.micro_batch_size), strict=True)])
            loss = loss.mean()
        else:
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip if t.grad_clip > 0 else float("inf"))
        opt.step()
        sched.step()
        run.step_seconds.append(time.perf_counter() - started)
        run.losses.append(float(loss.detach()))
        run.grad_norms.append(float(norm))
    return run
