"""The `retrainer` command line: one verb per lifecycle stage.

Each stage module owns its verbs through a `register(subparsers)` function that
adds a subparser and sets `handler=` (a callable taking the parsed namespace and
returning an exit code). Heavy imports (torch, deepspeed) stay inside handlers so
`retrainer --help` is instant.

Exit codes: 0 success, 1 runtime failure, 2 invalid input (config, arguments,
manifest), 3 plan does not fit. Errors print one clear line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tasks.config import ConfigError
from tasks.errors import RetrainerError

COMMAND_MODULES = [
    "tasks.data",
    "tasks.plan",
    "tasks.warm.cli",
    "tasks.train.cli",
    "tasks.evaluate",
    "tasks.registry.cli",
    "tasks.lifecycle",
    "tasks.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrainer", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
