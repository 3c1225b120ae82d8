"""Airflow plugin: the retrainer model registry as a page in the Airflow 3 UI.

The FastAPI app (plugins/retrainer_registry/app.py) is mounted by the API server under
/retrainer; the external view puts a "Model registry" entry in the UI's Browse menu that
shows it inside Airflow (same origin, same login). The run-notes listener puts a retrain
run's outcome (such as the gate's refusal) in the run's note. The conf guard (a root middleware of
the API server) refuses a trigger whose conf names a key that is none of the DAG's params.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.plugins_manager import AirflowPlugin
from retrainer_registry import run_notes
from retrainer_registry.app import app
from retrainer_registry.conf_guard import RefuseUnknownConf

URL_PREFIX = "/retrainer"


class RetrainerRegistryPlugin(AirflowPlugin):
    name = "retrainer_registry"
    listeners: ClassVar[list[Any]] = [run_notes]
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [{"app": app, "url_prefix": URL_PREFIX, "name": "Model registry"}]
    fastapi_root_middlewares: ClassVar[list[dict[str, Any]]] = [
        {"middleware": RefuseUnknownConf, "name": "retrainer: refuse unknown conf keys"}
    ]
    external_views: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "Model registry",
            "href": URL_PREFIX.lstrip("/") + "/",
            "destination": "nav",
            "category": "browse",
            "url_route": "model-registry",
        }
    ]
