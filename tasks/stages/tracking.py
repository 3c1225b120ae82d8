"""What the stages after training tell the trackers: the evaluation's numbers (TensorBoard files in the run
directory, the run's MLflow run) and the published version (the version's record links to the MLflow run, and
the MLflow run is tagged with the version).

A tracker that does not answer is one warning per process, never a failed stage (the MLflow run is found by
its name, the experiment key: tasks/train/mlflow_run.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tasks.base.credentials import redact
from tasks.config.schema import JobConfig
from tasks.train.checkpoint import run_dir_of
from tasks.train.tracking import TENSORBOARD_DIR, mlflow_experiment

if TYPE_CHECKING:
    from pathlib import Path

    from tasks.evaluate import Evaluated
    from tasks.stages.publish import PublishResult
    from tasks.train.mlflow_run import MlflowRun

log = logging.getLogger(__name__)

_down: set[str] = set()  # tracking URIs that failed in this process: warned about once, not asked again


def mlflow_run(cfg: JobConfig, experiment_key: str) -> MlflowRun | None:
    """The training run's MLflow run, or None (no MLflow configured, none found, or the tracker is down)."""
    uri = cfg.tracking.mlflow_uri
    if uri is None or uri in _down:
        return None
    from tasks.train.mlflow_run import MlflowRun

    return _call(uri, "find the run", lambda: MlflowRun.find(uri, mlflow_experiment(cfg), experiment_key))


def record_evaluation(cfg: JobConfig, evaluated: Evaluated) -> None:
    """The candidate's evaluation metrics at its checkpoint's step, as `eval/<suite>.<metric>`."""
    if evaluated.step is None:
        return
    values = {f"eval/{name}": float(value) for name, value in evaluated.metrics.items()}
    if cfg.tracking.tensorboard:
        logdir = run_dir_of(evaluated.checkpoint_dir) / TENSORBOARD_DIR
        try:
            _write_scalars(logdir, values, evaluated.step)
        except OSError as exc:  # e.g. node-local run directories, not on this machine: the stage goes on
            log.warning("tracking: the evaluation's TensorBoard file in %s was not written: %s", logdir, exc)
    run = mlflow_run(cfg, evaluated.experiment_key)
    if run is not None:
        _call(run.uri, "log the evaluation", lambda: run.log_metrics(values, evaluated.step, int(time.time() * 1000)))


def _write_scalars(logdir: Path, values: dict[str, float], step: int) -> None:
    """One TensorBoard event file of scalars at `step`, written with TensorBoard's own writer: torch's
    `SummaryWriter` is this plus a torch import (~1.3 s of CPU in every evaluate task for a few numbers)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(logdir))
    try:
        writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(
            value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])))
    finally:
        writer.close()


def version_link(run: MlflowRun | None) -> dict[str, Any]:
    """What a version's record keeps of its MLflow run (in its metrics, under `tracking`); empty without one."""
    if run is None:
        return {}
    return {"tracking": {"mlflow_run_id": run.run_id, "mlflow_experiment_id": run.experiment_id,
                         "mlflow_run_url": redact(run.url)}}


def tag_version(run: MlflowRun | None, published: PublishResult) -> None:
    """The MLflow run links back to the version it produced."""
    if run is not None:
        _call(run.uri, "tag the version", lambda: run.set_tags({
            "retrainer.version": str(published.version), "retrainer.alias": published.alias,
            "retrainer.parent_version": "none" if published.parent_version is None else str(published.parent_version),
        }))


def _call(uri: str, what: str, fn: Any) -> Any:
    """`fn()`, or None with the one warning when the tracker at `uri` fails (it is not asked again here)."""
    if uri in _down:
        return None
    try:
        return fn()
    except Exception as exc:  # refused, timed out, an HTTP error: the stage goes on without the tracker
        _down.add(uri)
        log.warning("tracking: MLflow at %s did not answer (%s: %s: %s); going on without it", redact(uri), what,
                    type(exc).__name__, " ".join(str(exc).split())[:300])
        return None
