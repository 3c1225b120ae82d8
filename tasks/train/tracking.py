"""A run's curves where teams already look: TensorBoard event files in the run directory and, with
`tracking.mlflow_uri`, an MLflow run named by the experiment key (tasks/train/mlflow_run.py).

Why a thread: rank 0 hands each step's numbers to a bounded queue and goes on; a background thread writes
them. A full queue drops rows (one warning), and a tracker that does not answer is one warning and is left
alone for the rest of the run: tracking never slows or fails training. `tracking_spec` is what the launching
process puts in the ranks' input file: the resolved config with credentials redacted exactly as a version
records it (tasks/base/credentials.py `redact`), and the run's lineage as tags.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from tasks.base.credentials import redact
from tasks.config.schema import JobConfig
from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"  # <run dir>/tensorboard: every writer's event files (ranks', evaluation's)
QUEUE_ROWS = 1024  # steps' rows waiting for the writer thread before new ones are dropped
CLOSE_WAIT_S = 60.0  # how long the end of training waits for the writer thread to send what is queued
# Airflow puts the task's run in its environment (airflow.sdk's context_to_airflow_vars); tasks/ never imports it.
AIRFLOW_DAG_ENV, AIRFLOW_RUN_ENV = "AIRFLOW_CTX_DAG_ID", "AIRFLOW_CTX_DAG_RUN_ID"


def mlflow_experiment(cfg: JobConfig) -> str:
    return cfg.tracking.mlflow_experiment or cfg.name


def run_tags(cfg: JobConfig, run: RunIdentity) -> dict[str, str]:
    """What an MLflow run says of its lineage: model, experiment key, data manifest, parent version, the Airflow run
    that trained it (when one did)."""
    from tasks.inputs.adapter import parent_version

    parent = parent_version(cfg, run)
    tags = {"retrainer.model": cfg.publish.model_name, "retrainer.experiment_key": run.experiment_key,
            "retrainer.data_manifest": run.data_manifest_hash, "retrainer.data_url": redact(run.data_url),
            "retrainer.parent_version": "none" if parent is None else str(parent),
            "retrainer.started_from": redact(run.init.origin)}
    if os.environ.get(AIRFLOW_RUN_ENV):
        tags["retrainer.airflow_run"] = f"{os.environ.get(AIRFLOW_DAG_ENV, '')}/{os.environ[AIRFLOW_RUN_ENV]}"
    return tags


def tracking_spec(cfg: JobConfig, run: RunIdentity) -> dict[str, Any]:
    """The training ranks' `tracking` input (JSON, no credentials): TensorBoard on or off, and the MLflow run."""
    from tasks.train.mlflow_run import flat_params

    t = cfg.tracking
    mlflow = None
    if t.mlflow_uri:
        mlflow = {"uri": t.mlflow_uri, "experiment": mlflow_experiment(cfg), "run_name": run.experiment_key,
                  "params": flat_params(redact(cfg.model_dump(mode="json"))), "tags": run_tags(cfg, run)}
    return {"tensorboard": t.tensorboard, "mlflow": mlflow}


class Tracker:
    """Rank 0's sender of per-step numbers to TensorBoard and MLflow (a no-op elsewhere, or with nothing on)."""

    def __init__(self, spec: dict[str, Any] | None, run_dir: Path, *, enabled: bool) -> None:
        spec = spec or {}
        self.tensorboard = enabled and bool(spec.get("tensorboard"))
        self.mlflow_spec = spec.get("mlflow") if enabled else None
        self.enabled = self.tensorboard or self.mlflow_spec is not None
        self.run_dir = run_dir
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_ROWS)
        self._dropped = False
        self._writer: Any = None
        self._mlflow: Any = None
        self._mlflow_down = False
        self._status = "FINISHED"
        if self.enabled:
            self._thread = threading.Thread(target=self._work, name="tracking", daemon=True)
            self._thread.start()

    def log(self, step: int, values: dict[str, float | None]) -> None:
        """Queue one step's numbers (None values are left out); never waits."""
        if not self.enabled:
            return
        row = {k: float(v) for k, v in values.items() if v is not None}
        try:
            self._queue.put_nowait((step, row))
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                log.warning("tracking: the writer is %d rows behind; dropping rows (telemetry.jsonl has them all)",
                            QUEUE_ROWS)

    def close(self, *, failed: bool = False) -> None:
        """Send what is queued (waiting at most CLOSE_WAIT_S) and end the MLflow run as finished or failed."""
        if not self.enabled:
            return
        self._status = "FAILED" if failed else "FINISHED"
        with contextlib.suppress(queue.Full):  # the join below bounds the wait either way
            self._queue.put(None, timeout=CLOSE_WAIT_S)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("tracking: still sending after %.0fs at the end of training; leaving the rest unsent",
                        CLOSE_WAIT_S)

    def _work(self) -> None:
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR))
        if self.mlflow_spec is not None:
            self._mlflow_call("start the run", self._open_mlflow)
        while (item := self._queue.get()) is not None:
            step, row = item
            if self._writer is not None:
                for name, value in row.items():
                    self._writer.add_scalar(name, value, step)
            if self._mlflow is not None:
                self._mlflow_call("log", self._mlflow.log_metrics, row, step, int(time.time() * 1000))
        if self._writer is not None:
            self._writer.close()
        if self._mlflow is not None:
            self._mlflow_call("end the run", self._mlflow.finish, self._status)

    def _open_mlflow(self) -> None:
        from tasks.train.mlflow_run import MlflowRun

        s = self.mlflow_spec
        assert s is not None
        self._mlflow = MlflowRun.open(s["uri"], s["experiment"], s["run_name"], s["params"], s["tags"])
        log.info("tracking: MLflow run %s", self._mlflow.url)

    def _mlflow_call(self, what: str, fn: Any, *args: Any) -> None:
        """A call to MLflow; the first failure is the one warning, and MLflow is left alone after it."""
        if self._mlflow_down:
            return
        try:
            fn(*args)
        except Exception as exc:  # any failure of the tracker (refused, timeout, HTTP error): training goes on
            self._mlflow_down, self._mlflow = True, None
            assert self.mlflow_spec is not None
            log.warning("tracking: MLflow at %s did not take the run's numbers (%s: %s); training goes on "
                        "without it", redact(self.mlflow_spec["uri"]), what, _short(exc))


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
