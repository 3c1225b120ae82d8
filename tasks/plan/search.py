"""Rank the (tp, pp, dp, micro-batch) layouts that fit a GPU count."""

from __future__ import annotations

import logging

from tasks.base.dataset_format import PlannedData
from tasks.base.errors import ConfigError, InvalidInputError
from tasks.base.layout import Layout
from tasks.config.schema import JobConfig
from tasks.plan.budget import Plan, plan

log = logging.getLogger(__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: JobConfig, gpus: int, *, device: str | None = None, reserve_gib: float = 0.0,
           include_infeasible: bool = False, attention: str = "sdpa",
           data: PlannedData = PlannedData()) -> list[Plan]:
    """Every valid layout for `gpus`, keeping the global batch (micro_batch_size x micro_batches x dp).

    For each (tp, pp, dp) with tp*pp*dp == gpus, try the micro-batch sizes that
    keep the global batch whole (with the config's ZeRO stage, capped at 1 under
    pipelining). Ranked: fitting plans first, then warnings-free, then the
    shortest estimated step, then the most memory headroom; `data` as `plan` takes it.
    """
    if gpus <= 0:
        raise InvalidInputError(f"--search GPU count must be positive, got {gpus}")
    p, t = cfg.parallel, cfg.train
    global_samples = t.micro_batch_size * p.micro_batches * p.dp
    plans: list[Plan] = []
    for layout in (Layout(tp=tp, pp=pp, dp=gpus // (tp * pp)) for tp in _divisors(gpus)
                   for pp in _divisors(gpus // tp)):
        if global_samples % layout.dp:
            continue
        per_dp = global_samples // layout.dp
        for mbs in _divisors(per_dp):
            overrides = {
                **{f"parallel.{axis}": size for axis, size in layout.record().items()},
                "parallel.micro_batches": per_dp // mbs, "train.micro_batch_size": mbs,
                "parallel.zero_stage": min(p.zero_stage, 1) if layout.pp > 1 else p.zero_stage,
            }
            try:
                candidate = cfg.with_overrides(overrides)
                result = plan(candidate, world_size=gpus, device=device, reserve_gib=reserve_gib,
                              attention=attention, data=data)  # type: ignore[arg-type]
            except (ConfigError, InvalidInputError) as exc:
                log.debug("layout %s refused: %s", overrides, exc)
                continue
            if result.fits or include_infeasible:
                plans.append(result)
    plans.sort(key=lambda r: (not r.fits, bool(r.warnings), r.step.step_s, -r.memory.headroom))
    return plans
