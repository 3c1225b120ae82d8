"""Where retrainer keeps this machine's state (the embedded registry, default run directories): a module of
its own so that the processes which only need the path (the CLI's registry verbs) do not load the job config."""

from __future__ import annotations

import os
from pathlib import Path


def retrainer_home() -> Path:
    """$RETRAINER_HOME, else `.retrainer` under the working directory."""
    return Path(os.environ.get("RETRAINER_HOME") or ".retrainer").resolve()
