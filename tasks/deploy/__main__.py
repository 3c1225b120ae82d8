"""`python -m tasks.deploy MODULE:FUNCTION`: the process a `deploy.entry_point` hook runs in (tasks.deploy.run_hook).

The function gets the `DeployTarget` rebuilt from the `RETRAINER_DEPLOY_*` environment; raising fails the deploy.
"""

from __future__ import annotations

import logging
import sys

from tasks.deploy import call_entry_point

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tasks.deploy MODULE:FUNCTION")
    call_entry_point(sys.argv[1])
