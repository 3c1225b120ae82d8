"""`retrainer run CONFIG`: the whole lifecycle for one config in this process (tasks/stages/lifecycle.py)."""

from __future__ import annotations

import argparse
import json


def _cmd_run(args: argparse.Namespace) -> int:
    from tasks.models.resolve import load_config
    from tasks.stages.lifecycle import describe_outcome, run_lifecycle

    cfg = load_config(args.config, {"train.steps": args.steps})
    out = run_lifecycle(cfg, force=args.force, dry_run=args.dry_run)
    print(json.dumps(out, indent=2, default=str) if args.json else "\n".join(describe_outcome(out)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the whole lifecycle for one config in this process")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--force", action="store_true", help="launch even if the plan says it cannot fit, or a "
                   "stopped run at another global batch would be left behind")
    p.add_argument("--dry-run", action="store_true", help="plan and warm only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_run)
