"""`python -m tasks.deploy MODULE:FUNCTION`: the process a `deploy.entry_point` hook runs in (tasks/deploy/handoff.py).

The function gets the `DeployTarget` rebuilt from the `RETRAINER_DEPLOY_*` environment; raising fails the deploy.
"""

from __future__ import annotations

import logging
import os
import sys

from tasks.config.util import load_entry_point
from tasks.deploy.target import DeployTarget

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tasks.deploy MODULE:FUNCTION")
    load_entry_point(sys.argv[1], "deploy")(DeployTarget.from_env(dict(os.environ)))
