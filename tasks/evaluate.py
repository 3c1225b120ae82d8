"""Evaluate stage: held-out loss and perplexity of a committed checkpoint.

Why single-process: evaluation must not depend on the training layout, and the
number the gate compares must be reproducible. It reads a checkpoint's layer
files or a published Hugging Face directory (tasks/models/weights.py); at model
size it has to run as ranks on the cluster (not yet: see the issue on
distributed evaluation). The
windows are a deterministic function of the config (evaluate.batches x
evaluate.batch_size windows, evenly spaced over the `heldout/` split), and the
model runs in eval mode (no dropout).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from tasks.config import JobConfig
from tasks.errors import InvalidInputError

log = logging.getLogger(__name__)


def evaluate(cfg: JobConfig, checkpoint_dir: str | Path, dataset_dir: str | Path, *,
             experiment_key: str | None = None) -> dict[str, Any]:
    """Held-out metrics of the checkpoint's weights as they will be served (rounded to
    `publish.export_dtype`, exactly as the export stores them: what is judged is what is served);
    InvalidInputError for incomplete checkpoints, another model's, or (with `experiment_key`) another run's."""
    from tasks.train.checkpoint import validate_checkpoint_dir

    checkpoint_dir = Path(checkpoint_dir)
    marker = validate_checkpoint_dir(checkpoint_dir, cfg.fingerprint(), experiment_key)
    metrics = evaluate_weights(cfg, checkpoint_dir, dataset_dir, as_dtype=cfg.publish.export_dtype)
    return {
        **metrics,
        "checkpoint_dir": str(checkpoint_dir),
        "checkpoint_tag": marker.get("tag"),
        "step": marker.get("step"),
        "experiment_key": marker["experiment_key"],
    }


def evaluate_weights(cfg: JobConfig, weights: str | Path, dataset_dir: str | Path, *,
                     as_dtype: str | None = None) -> dict[str, Any]:
    """Held-out loss of any weights of this model shape (a checkpoint or a published artifact), so the
    gate can score the live model on the same windows as the new one."""
    import numpy as np
    import torch

    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.models.weights import load_reference
    from tasks.train.data import TokenWindows, split_inputs

    model = load_reference(weights, cfg.model, as_dtype=as_dtype)
    lm_loss = get_family(cfg.model.family).make_loss_fn(TPGroup())
    model.eval()
    m, e = cfg.model, cfg.evaluate
    windows = TokenWindows(dataset_dir, "heldout", m.seq_len, m.vocab_size)
    total = e.batches * e.batch_size
    # Evenly spaced windows; wraps around when the split holds fewer windows than requested.
    order = (np.arange(total) * max(1, len(windows) // total)) % len(windows)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for b in range(e.batches):
            x, y = split_inputs(windows.get(order[b * e.batch_size : (b + 1) * e.batch_size]))
            n = y.numel()
            loss_sum += float(lm_loss(model(x), y)) * n
            tokens += n
    loss = loss_sum / tokens
    if not math.isfinite(loss):
        raise InvalidInputError(f"{weights}: held-out loss is not finite ({loss})")
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "batches": e.batches,
            "batch_size": e.batch_size}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("evaluate", help="held-out loss/perplexity of a committed checkpoint")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--checkpoint", required=True, help="committed checkpoint dir (has COMPLETE)")
    p.add_argument("--dataset-dir", help="warmed dataset dir (default: warm it from the config)")
    p.add_argument("--output", help="also write the metrics JSON to this file (atomically)")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.config import load_config
    from tasks.fsutil import atomic_write_json

    cfg = load_config(args.config)
    dataset_dir = args.dataset_dir
    if dataset_dir is None:
        from tasks.warm import warm_for_config

        dataset_dir = warm_for_config(cfg).dataset_dir
    metrics = evaluate(cfg, args.checkpoint, dataset_dir)
    if args.output:
        atomic_write_json(args.output, metrics)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0
