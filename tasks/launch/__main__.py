"""`python -m tasks.launch --config C --dataset-dir D`: train through the configured launcher.

Why a module entry point: a separate process to kill in tests, and a way for operators
to run one launch by hand; prints the summary JSON, exits with the error's exit code.
Every engine option comes from the config's `cluster` section; the ranks inherit this
process's environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tasks.config import ConfigError, load_config
from tasks.errors import RetrainerError
from tasks.launch import get_launcher


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.launch")
    parser.add_argument("--config", required=True, help="job config (YAML or JSON)")
    parser.add_argument("--dataset-dir", required=True, help="warmed dataset directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        cfg = load_config(args.config)
        summary = get_launcher(cfg).run(cfg, args.dataset_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RetrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
