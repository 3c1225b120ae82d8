"""What each rank's DeepSpeed engine optimizes, for tests that assert which parameters train (tests/lora).

`HOOK_OPTIMIZER_PARAMS=DIR`: after the engine is built, every rank writes `DIR/rank-<R>.json`: the reference
names of the parameters in its optimizer's param groups (ZeRO's bit16 groups: the model's own tensors) and
of the ones outside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.models.weights import local_named_params


def record(trainer, directory: str) -> None:
    engine = trainer.engine
    optimizer = engine.optimizer
    groups = getattr(optimizer, "bit16_groups", None) or [g["params"] for g in optimizer.param_groups]
    in_optimizer = {id(p) for group in groups for p in group}
    names = dict(local_named_params(engine.module))
    out = {"optimized": sorted(n for n, p in names.items() if id(p) in in_optimizer),
           "outside": sorted(n for n, p in names.items() if id(p) not in in_optimizer),
           "optimized_elements": sum(p.numel() for group in groups for p in group),
           "unnamed_in_optimizer": len(in_optimizer - {id(p) for p in names.values()})}
    path = Path(directory) / f"rank-{os.environ['RANK']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
