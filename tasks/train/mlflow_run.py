"""One training run's MLflow run, found or made by name (the experiment key), through MLflow's client.

Why by name: the run's ranks, its evaluation and its publish are separate processes (separate Airflow tasks),
and a resumed run continues the same MLflow run; the experiment key names all of them. MLflow is imported
here only, and only when `tracking.mlflow_uri` is set (it takes seconds to import). A tracker that does not
answer fails fast: MLflow's own retries (minutes by default) are cut to one, unless the environment sets them.
"""

from __future__ import annotations

import json
import os
from typing import Any

# What MLflow accepts (its REST API limits): longer values are cut, and a batch holds at most this many entries.
MAX_PARAM_VALUE = 6000
MAX_BATCH_METRICS = 1000
MAX_BATCH_PARAMS = 100


def _client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no call outside the cluster from a rank
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested JSON object as MLflow params: dotted keys, scalars as text, lists as JSON, each value cut to fit."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name] = text[:MAX_PARAM_VALUE]
    return out


class MlflowRun:
    """A run of an MLflow experiment: its metrics by step, its tags, its end."""

    def __init__(self, client: Any, uri: str, experiment_id: str, run_id: str) -> None:
        self.client, self.uri, self.experiment_id, self.run_id = client, uri, experiment_id, run_id

    @classmethod
    def find(cls, uri: str, experiment: str, name: str) -> MlflowRun | None:
        """The newest run called `name` in `experiment`, or None."""
        client = _client(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        return cls(client, uri, exp.experiment_id, runs[0].info.run_id) if runs else None

    @classmethod
    def open(cls, uri: str, experiment: str, name: str, params: dict[str, str], tags: dict[str, str]) -> MlflowRun:
        """The run called `name` (made, with `params`, if it does not exist yet: a resumed run continues it),
        marked running, with `tags` set."""
        from mlflow.entities import Param, RunTag

        run = cls.find(uri, experiment, name)
        if run is None:
            client = _client(uri)
            exp = client.get_experiment_by_name(experiment)
            experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
            run = cls(client, uri, experiment_id, client.create_run(experiment_id, run_name=name).info.run_id)
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), MAX_BATCH_PARAMS):
                run.client.log_batch(run.run_id, params=items[i:i + MAX_BATCH_PARAMS])
        else:
            run.client.update_run(run.run_id, status="RUNNING")
        run.client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        return run

    @property
    def url(self) -> str:
        """Where a person sees the run (the tracking server's page for an http(s) URI, else the URI and ids)."""
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{self.uri} experiment {self.experiment_id} run {self.run_id}"

    def log_metrics(self, values: dict[str, float], step: int, timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        items = [Metric(k, float(v), timestamp_ms, step) for k, v in values.items()]
        for i in range(0, len(items), MAX_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=items[i:i + MAX_BATCH_METRICS])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
