"""`retrainer train CONFIG [--dataset-dir DIR] [--steps N] [--json]`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tasks.errors import InvalidInputError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a model with DeepSpeed (tp x pp x dp ranks)")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--dataset-dir", help="warmed dataset dir (default: warm it, and any data.replay sources, "
                                         "from the config)")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.launch import train  # lazy: a verb loads only what it runs (retrainer --help stays instant)
    from tasks.resolve import load_config  # lazy: a verb loads only what it runs (retrainer --help stays instant)

    cfg = load_config(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise InvalidInputError(f"--steps must be >= 1, got {args.steps}")
        cfg = cfg.with_overrides({"train.steps": args.steps})
    from tasks.run import for_dataset  # lazy: a verb loads only what it runs (retrainer --help stays instant)

    if args.dataset_dir is not None:
        dataset_dir, run = args.dataset_dir, for_dataset(cfg, args.dataset_dir)
    else:
        from tasks.warm import warm_mixture  # lazy: a verb loads only what it runs (retrainer --help stays instant)

        primary, *replay = warm_mixture(cfg)
        dataset_dir, run = primary.dataset_dir, for_dataset(cfg, primary.dataset_dir, [r.dataset_dir for r in replay])
    summary = train(cfg, dataset_dir, run=run)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(
            f"trained {cfg.name}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"checkpoint {summary['checkpoint_dir']}"
        )
    return 0
