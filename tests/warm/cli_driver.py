"""Run the real `retrainer` CLI main with only the data + warm verbs registered.

Subprocess tests use this so they exercise our verbs (and the CLI's exit-code mapping)
without depending on every other stage's module importing cleanly.
"""

from __future__ import annotations

import sys

import tasks.cli

if __name__ == "__main__":
    tasks.cli.COMMAND_MODULES = ["tasks.data", "tasks.warm.cli"]
    sys.exit(tasks.cli.main(sys.argv[1:]))
