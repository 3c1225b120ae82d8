"""A run where teams already look: TensorBoard event files read back with TensorBoard's own reader, and a real
`mlflow server` (SQLite backend, local artifact root) holding the run, its redacted config, its curves by step,
its lineage tags and the version it produced; a tracker that is down costs one warning, never the run."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tasks.base.credentials import REDACTED
from tests.services import MlflowServer, free_port, require
from tests.test_weekly_retrain import new_week, retrainer, run, show, week_config

pytestmark = pytest.mark.multiproc

SECRET = "s3cr3t-tracking-value"  # a credential in the config: it must never reach MLflow


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    server = MlflowServer.start(tmp_path / "mlflow")
    try:
        yield server
    finally:
        server.stop()


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the run's TensorBoard files, as TensorBoard itself reads them."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        require(False, "tensorboard (pip install -e .)")
        raise
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_weekly_run_shows_up_in_tensorboard_and_mlflow_with_its_version(
        tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    config = week_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["parallel"]["dp"] = 2  # two ranks: only rank 0 tracks
    cfg["train"]["checkpoint_storage_options"] = {"secret": SECRET}
    cfg["tracking"] = {"mlflow_uri": mlflow_server.uri}
    config.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("AIRFLOW_CTX_DAG_ID", "retrain_tiny-llama")  # what Airflow sets in a task's environment
    monkeypatch.setenv("AIRFLOW_CTX_DAG_RUN_ID", "scheduled__2026-12-07T03:00:00+00:00")
    assert retrainer("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'registry.db'}", tmp=tmp_path).returncode == 0
    new_week(config, tmp_path, seed=101)

    week = run(config, tmp_path)

    key, steps = week["experiment_key"], cfg["train"]["steps"]
    losses, version = week["train"]["losses"], week["publish"]["version"]
    evaluated = week["evaluate"]["metrics"]
    # TensorBoard: rank 0's curves by step, the checkpoint stalls at the saves, the evaluation at the last step.
    series = scalars(Path(cfg["train"]["output_dir"]) / key[:16])
    assert [s for s, _ in series["train/loss"]] == list(range(1, steps + 1))
    assert [v for _, v in series["train/loss"]] == pytest.approx(losses, rel=1e-6)
    for name in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_s"):
        assert [s for s, _ in series[name]] == list(range(1, steps + 1)) and all(v > 0 for _, v in series[name])
    assert [s for s, _ in series["checkpoint/stall_s"]] == [4, 8]
    assert "train/mfu" not in series  # no MFU on CPU (no peak to divide by)
    assert {f"eval/{m}": [(steps, pytest.approx(v, rel=1e-6))] for m, v in evaluated.items()} == {
        k: v for k, v in series.items() if k.startswith("eval/")}

    # MLflow: one run named by the experiment key in the job's experiment.
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name(cfg["name"])
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == key and found.info.status == "FINISHED"
    params = found.data.params
    assert params["train.steps"] == str(steps) and params["parallel.dp"] == "2" and params["name"] == cfg["name"]
    assert params["train.checkpoint_storage_options.secret"] == REDACTED
    assert not [k for k, v in params.items() if SECRET in v]
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == list(enumerate(losses, start=1))
    for name, value in evaluated.items():
        assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, f"eval/{name}")] == [
            (steps, pytest.approx(value))]
    tags = found.data.tags
    assert tags["retrainer.data_manifest"] == week["run"]["data_manifest_hash"]
    assert tags["retrainer.parent_version"] == "none"  # week 1 starts from scratch
    assert tags["retrainer.airflow_run"] == "retrain_tiny-llama/scheduled__2026-12-07T03:00:00+00:00"
    assert tags["retrainer.version"] == str(version) and tags["retrainer.alias"] == "production"
    # ... and the version's record links to it.
    (record,) = show(tmp_path)["versions"]
    link = record["metrics"]["tracking"]
    assert link["mlflow_run_id"] == found.info.run_id
    assert link["mlflow_run_url"].startswith(mlflow_server.uri) and found.info.run_id in link["mlflow_run_url"]


def test_a_tracker_that_is_down_is_one_warning_and_the_run_succeeds(make_config, dataset_dir: Path,
                                                                    tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = make_config({"train.steps": 3, "train.checkpoint_every": 3, "tracking.mlflow_uri": closed})
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    done = subprocess.run([sys.executable, "-m", "tasks.cli", "train", str(config_path), "--dataset-dir",
                           str(dataset_dir), "--json"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["trained_steps"] == 3
    warnings = [line for line in done.stderr.splitlines() if "tracking:" in line]
    assert len(warnings) == 1 and "MLflow at " + closed in warnings[0], done.stderr[-3000:]
    run_dir = Path(summary["checkpoint_dir"]).parent.parent
    assert [s for s, _ in scalars(run_dir)["train/loss"]] == [1, 2, 3]  # TensorBoard still has the run


def test_the_stages_after_training_warn_once_when_the_tracker_is_down(make_config, caplog) -> None:
    require(importlib.util.find_spec("mlflow") is not None, "mlflow (pip install -e '.[test]')")
    from tasks.stages.tracking import mlflow_run, version_link

    cfg = make_config({"tracking.mlflow_uri": f"http://127.0.0.1:{free_port()}"})
    with caplog.at_level(logging.WARNING, logger="tasks.stages.tracking"):
        runs = [mlflow_run(cfg, "0" * 64) for _ in range(3)]  # evaluate, publish, ...: one process
    assert runs == [None] * 3 and version_link(None) == {}  # the version is published without a link
    assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) == 1
