"""The `retrainer` command line: every verb's arguments and handler, one module per verb group.

`COMMAND_MODULES` below is the one verb table: verb -> the tasks/cli/ module whose `register(subparsers)` adds
its subparser and sets `handler=` (a callable taking the parsed namespace and returning an exit code). A handler
parses, calls the business logic in its layer (tasks/stages/, tasks/data/, tasks/deploy/, ...) and prints; the
logic itself never lives here. The package sits on top of the import graph, so a verb may drive several stages.

The lazy-import rule, for every module of this package: at module level import only the standard library and
light tasks.base modules; everything a handler runs (pydantic configs, the registry, torch, deepspeed) is
imported inside the handler. `retrainer --help` imports every verb module and stays instant, and a command
imports only the module that owns its verb: a no-op `retrainer warm-url` finishes in well under 0.1 s, before
pydantic or torch would even have loaded.

Exit codes: 0 success, 1 runtime failure, 2 invalid input (config, arguments,
manifest), 3 plan does not fit. Errors print one clear line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tasks.base.errors import ConfigError, RetrainerError

# verb -> the module whose register() adds it (tests/test_cli.py checks this against the modules)
COMMAND_MODULES = {
    "make-data": "tasks.cli.data",
    "manifest": "tasks.cli.data",
    "prepare-data": "tasks.cli.data",
    "plan": "tasks.cli.plan",
    "warm": "tasks.cli.warm",
    "warm-url": "tasks.cli.warm",
    "train": "tasks.cli.train",
    "evaluate": "tasks.cli.evaluate",
    "db": "tasks.cli.registry",
    "publish": "tasks.cli.registry",
    "promote": "tasks.cli.promote",
    "rollback": "tasks.cli.registry",
    "registry": "tasks.cli.registry",
    "run": "tasks.cli.run",
    "deploy": "tasks.cli.deploy",
    "gc": "tasks.cli.gc",
    "demo": "tasks.cli.demo",
    "airflow": "tasks.cli.airflow_cmd",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every verb, or only the owning module's verbs when `argv` names a known one."""
    parser = argparse.ArgumentParser(prog="retrainer", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verb = next((a for a in argv or () if not a.startswith("-")), None)
    modules = [COMMAND_MODULES[verb]] if verb in COMMAND_MODULES else list(dict.fromkeys(COMMAND_MODULES.values()))
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return 2
    except RetrainerError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
