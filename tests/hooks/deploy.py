"""A deploy hook as a user's package would have one (`deploy.entry_point: tests.hooks.deploy:record`).

It appends what it received to `<models_dir>/hook.jsonl` (the test reads it back): the target, and whether the
directory it was handed is the verified model (its config.json is there).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tasks.deploy.target import DeployTarget


def record(target: DeployTarget) -> None:
    model_dir = Path(target.model_dir)
    entry = {**asdict(target), "has_config": (model_dir / "config.json").is_file()}
    with (model_dir.parent / "hook.jsonl").open("a") as fh:
        fh.write(json.dumps(entry) + "\n")
