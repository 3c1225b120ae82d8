"""The `tracking` section: where a run's curves go besides telemetry.jsonl, summary.json and the registry page
(TensorBoard event files in the run directory, and an MLflow server when one is named)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from tasks.config.bounds import Strict


class TrackingConfig(Strict):
    """TensorBoard files are on by default (they cost a file in the run directory); MLflow only with a URI."""

    tensorboard: bool = Field(True, description="rank 0 writes TensorBoard event files into <run dir>/tensorboard")
    mlflow_uri: str | None = Field(
        None, min_length=1, description="MLflow tracking URI (http(s)://host:port, or a local store); one MLflow run "
                                        "per training run, named by its experiment key; None: no MLflow")
    mlflow_experiment: str | None = Field(None, min_length=1, max_length=500,
                                          description="the MLflow experiment (default: the job's name)")

    @field_validator("mlflow_uri")
    @classmethod
    def _no_password(cls, uri: str | None) -> str | None:
        """The URI reaches the ranks' input file: credentials go by MLflow's own environment variables."""
        if uri is not None:
            try:
                password = urlsplit(uri).password
            except ValueError as exc:
                raise ValueError(f"not a URI: {exc}") from None
            if password:
                raise ValueError("holds a password; give it as MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD "
                                 "(or MLFLOW_TRACKING_TOKEN) in the environment instead")
        return uri
