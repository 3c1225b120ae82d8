"""`retrainer gc CONFIG [--dry-run] [--json]`: reclaim by the config's retention (tasks/stages/housekeeping.py)."""

from __future__ import annotations

import argparse
import json


def _cmd_gc(args: argparse.Namespace) -> int:
    from tasks.models.resolve import load_config
    from tasks.stages.housekeeping import describe, gc

    report = gc(load_config(args.config), dry_run=args.dry_run)
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else describe(report))
    return 1 if report.failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="reclaim run directories and unreferenced artifacts by the config's retention")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted (paths, bytes); delete nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_gc)
