"""`retrainer evaluate CONFIG --checkpoint DIR`: every suite's metrics of a committed checkpoint (tasks/evaluate/)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("evaluate", help="every suite's metrics of a committed checkpoint, scored by ranks")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--checkpoint", required=True, help="committed checkpoint dir (has COMPLETE)")
    p.add_argument("--dataset-dir", help="warmed dataset dir (default: warm it from the config)")
    p.add_argument("--output", help="also write the metrics JSON to this file (atomically)")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.base.fsutil import atomic_write_json
    from tasks.data.warm import warm_for_config
    from tasks.evaluate import evaluate
    from tasks.models.resolve import load_config
    from tasks.runs.identity import RunIdentity
    from tasks.train.checkpoint import validate_checkpoint_dir

    cfg = load_config(args.config)
    run = RunIdentity.from_dict(validate_checkpoint_dir(args.checkpoint, cfg.fingerprint())["run"])
    dataset_dir = args.dataset_dir
    if dataset_dir is None:
        dataset_dir = warm_for_config(cfg).dataset_dir
    metrics = evaluate(cfg, run, args.checkpoint, dataset_dir).to_xcom()  # the same JSON as the stage's XCom
    if args.output:
        atomic_write_json(args.output, metrics)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0
