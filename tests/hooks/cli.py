"""`python -m tests.hooks.cli ARGS...`: the real `retrainer` CLI with the test hooks installed."""

from __future__ import annotations

import sys

from tests.hooks import install

if __name__ == "__main__":
    install()
    from tasks.cli import main

    sys.exit(main())
