"""`retrainer promote CONFIG --version N`: put a version on an alias through the alias's gate, in one process
(tasks/stages/promote.py; under Airflow, the promote_model DAG with its approval)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("promote", help="put a version on an alias through the alias's gate (and approval: "
                                              "under Airflow, the promote_model DAG)")
    p.add_argument("config", help="job config YAML (the model, its gate rules and suites, publish.policy)")
    p.add_argument("--version", required=True, type=int, help="the version to put on the alias")
    p.add_argument("--alias", help="the alias to move (default: the config's publish.alias)")
    p.add_argument("--force", action="store_true", help="skip the gate (a version rolled back from the alias may "
                                                        "then go back too); needs --reason")
    p.add_argument("--reason", default="", help="why (recorded in the alias history)")
    p.add_argument("--actor", help="who (default: $RETRAINER_ACTOR, else the OS user)")
    p.add_argument("--json", action="store_true", help="print the alias move as JSON")
    p.set_defaults(handler=_cmd_promote)


def _cmd_promote(args: argparse.Namespace) -> int:
    from tasks.models.resolve import ConfigSnapshot
    from tasks.stages.promote import promote

    job = ConfigSnapshot.take(args.config, {"publish.alias": args.alias})
    rec = promote(job, args.version, force=args.force, reason=args.reason, actor=args.actor)
    frm = "nothing" if rec.from_version is None else f"version {rec.from_version}"
    print(json.dumps(rec.to_dict(), indent=2, sort_keys=True) if args.json else
          f"{rec.model} {rec.alias}: {frm} -> version {rec.to_version} (promote, seq {rec.seq})")
    return 0
