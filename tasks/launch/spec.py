"""What names one rank job and where it writes, apart from the config it runs under.

Why its own value: a stage's rank job is not always the run's training. The evaluation ranks of a
run write into the run directory's `eval/<id>` and need an engine job name of their own (Slurm,
Kubernetes: a later attempt cancels a job of the same name before starting), while their config and
run identity stay the run's. Launchers take the job's directory and name from here only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JobSpec:
    """`name`: what the engine job is named after (a training's: its run id); `output_dir`: the job's directory
    (its worker config, status, summary, engine files; the ranks write there)."""

    name: str
    output_dir: Path

    def handle_fields(self) -> dict[str, str]:
        """The spec as a submitted job's handle (`Launcher.submit`, JSON) carries it."""
        return {"job_name": self.name, "output_dir": str(self.output_dir)}

    @classmethod
    def from_handle(cls, handle: Mapping[str, Any]) -> JobSpec:
        """The spec a submitted job's handle carries."""
        return cls(handle["job_name"], Path(handle["output_dir"]))


@dataclass(frozen=True)
class LaunchOptions:
    """What a rank job takes besides its config, data, name and run identity, built once by the stage that starts
    it and handed to the launcher (whose own state it never becomes).

    `init_path`: the local starting weights a fresh run loads. `node_warm`: first warm the dataset (and the
    starting weights) on every training node. `export`: the ranks write the final weights' Hugging Face shards
    into the store's staging area (tasks/train/export.py). `secret_env`: credentials the ranks need, passed by
    environment only. `evaluation`: what the evaluation ranks (tasks/evaluate/worker.py) evaluate; None: the
    ranks train."""

    init_path: Path | None = None
    node_warm: bool = False
    export: dict[str, Any] | None = None
    secret_env: dict[str, str] = field(default_factory=dict)
    evaluation: dict[str, Any] | None = None

    @property
    def evaluating(self) -> bool:
        """Whether the ranks are evaluation ranks."""
        return self.evaluation is not None

    @property
    def what(self) -> str:
        """What the ranks do, as messages name it."""
        return "evaluation" if self.evaluating else "training"
