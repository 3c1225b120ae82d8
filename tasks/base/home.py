"""Where retrainer's code and state are: the checkout the package runs from, and this machine's state (the embedded
registry, default run directories). A module of its own so that the processes which only need a path (the CLI's
registry and airflow verbs) do not load the job config."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout the package was installed from (tasks/base/home.py)


def retrainer_home() -> Path:
    """$RETRAINER_HOME, else `.retrainer` under the working directory."""
    return Path(os.environ.get("RETRAINER_HOME") or ".retrainer").resolve()
