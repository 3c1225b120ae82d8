"""`retrainer train CONFIG [--dataset-dir DIR] [--steps N] [--json]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tasks.base.errors import InvalidInputError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a model with DeepSpeed (tp x pp x dp ranks)")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--dataset-dir", help="warmed dataset dir (default: warm it, and any data.replay sources, "
                                         "from the config)")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.config.endpoints import registry_for
    from tasks.inputs.start import resolve_start
    from tasks.launch import train
    from tasks.models.resolve import load_config
    from tasks.runs.identity import for_dataset
    from tasks.stages.lifecycle import fetch_start_here

    cfg = load_config(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise InvalidInputError(f"--steps must be >= 1, got {args.steps}")
        cfg = cfg.with_overrides({"train.steps": args.steps})
    init, base = resolve_start(cfg, registry_for(cfg))  # train.init_from, resolved as `retrainer run` does
    if args.dataset_dir is not None:
        dataset_dir, replay_dirs = args.dataset_dir, []
    else:
        from tasks.data.warm import warm_mixture

        primary, *replay = warm_mixture(cfg)
        dataset_dir, replay_dirs = primary.dataset_dir, [r.dataset_dir for r in replay]
    run = for_dataset(cfg, dataset_dir, replay_dirs, init, base)
    init_path = fetch_start_here(cfg, run, Path(cfg.train.output_dir))
    summary = train(cfg, dataset_dir, run=run, init_path=init_path)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(
            f"trained {cfg.name} from {init.note}: {summary['steps']} steps, final loss "
            f"{summary['final_loss']:.4f}, checkpoint {summary['checkpoint_dir']}"
        )
    return 0
