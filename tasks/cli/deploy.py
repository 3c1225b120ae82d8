"""`retrainer deploy CONFIG [--json]`: the whole deploy in one process (tasks/deploy/run.py)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="pull the version an alias points to, smoke-test it, run the deploy hook "
                                      "(rolling the alias back on a failure)")
    p.add_argument("config", help="job config YAML (its deploy section)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.base.lock import default_holder
    from tasks.deploy.check import describe
    from tasks.deploy.run import run_deploy
    from tasks.models.resolve import load_config

    out = run_deploy(load_config(args.config), actor=default_holder("cli"))
    t = out["target"]
    print(json.dumps(out, indent=2) if args.json else
          f"deployed {t['model']} v{t['version']} ({t['alias']}) from {t['model_dir']}: {describe(out['smoke_test'])}")
    return 0
