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
        self.mlflow_spec: dict[str, Any] | None = spec.get("mlflow") if enabled else None
        # The sinks by name: what opens each (the event files' folder, the MLflow run's spec) until the writer
        # thread opens it; one that fails is warned about once and dropped (None).
        self._sinks: dict[str, Any] = {}
        if enabled and spec.get("tensorboard"):
            self._sinks["TensorBoard"] = run_dir / TENSORBOARD_DIR
        if self.mlflow_spec is not None:
            self._sinks["MLflow"] = self.mlflow_spec
        self.enabled = bool(self._sinks)
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_ROWS)
        self._dropped = False
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
        self._call("TensorBoard", "open the event file", self._open_tensorboard)
        self._call("MLflow", "start the run", self._open_mlflow)
        while (item := self._queue.get()) is not None:
            step, row = item
            self._call("TensorBoard", "write", _write_scalars, step, row)
            self._call("MLflow", "log", _log_metrics, step, row)
        self._call("TensorBoard", "close the event file", lambda w: w.close())
        self._call("MLflow", "end the run", lambda r, status: r.finish(status), self._status)

    def _open_tensorboard(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._sinks["TensorBoard"] = SummaryWriter(str(logdir))

    def _open_mlflow(self, s: dict[str, Any]) -> None:
        from tasks.train.mlflow_run import MlflowRun

        run = self._sinks["MLflow"] = MlflowRun.open(s["uri"], s["experiment"], s["run_name"], s["params"],
                                                     s["tags"])
        log.info("tracking: MLflow run %s", run.url)

    def _call(self, sink: str, what: str, fn: Any, *args: Any) -> None:
        """`fn(the sink, *args)` unless it is off or failed before; its first failure is the one warning, and the
        sink is left alone after it (training goes on: any exception, refused, timed out, an HTTP error, a full
        disk)."""
        target = self._sinks.get(sink)
        if target is None:
            return
        try:
            fn(target, *args)
        except Exception as exc:
            self._sinks[sink] = None
            where = f" at {redact(self.mlflow_spec['uri'])}" if sink == "MLflow" and self.mlflow_spec else ""
            log.warning("tracking: %s%s did not take the run's numbers (%s: %s: %s); training goes on without it",
                        sink, where, what, type(exc).__name__, " ".join(str(exc).split())[:300])


def _write_scalars(writer: Any, step: int, row: dict[str, float]) -> None:
    for name, value in row.items():
        writer.add_scalar(name, value, step)


def _log_metrics(run: Any, step: int, row: dict[str, float]) -> None:
    run.log_metrics(row, step, int(time.time() * 1000))
