"""Every DAG imports cleanly, with no deprecated Airflow imports, and is wired as designed."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dagbag():
    from airflow.dag_processing.dagbag import DagBag

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return DagBag(dag_folder=str(ROOT / "dags"))


def test_dagbag_imports_without_errors_or_deprecations(airflow_db: str) -> None:
    bag = _dagbag()
    assert bag.import_errors == {}
    assert {"retrain_tiny-llama", "rollback_model"} <= set(bag.dag_ids)


def test_retrain_dag_shape(airflow_db: str) -> None:
    dag = _dagbag().get_dag("retrain_tiny-llama")
    assert dag.max_active_runs == 1
    order = ["plan", "new_data", "warm", "not_dry_run", "train", "evaluate", "gate", "publish"]
    for upstream, downstream in itertools.pairwise(order):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    assert dag.get_task("train").retries >= 1
    # Evaluation runs as ranks on the training cluster: it takes the same pool, sized by its own layout.
    train, evaluate = dag.get_task("train"), dag.get_task("evaluate")
    assert train.pool == evaluate.pool == "training-local" and train.pool_slots == evaluate.pool_slots == 2
    assert set(dag.params.keys()) >= {"steps", "tp", "pp", "dp", "alias", "dry_run", "force"}


def test_dags_hold_no_business_logic() -> None:
    """dags/ may only wire: it imports airflow.sdk, tasks and the plugins' Airflow glue (retrainer_airflow: the
    rank-job operator and trigger), nothing that computes."""
    for path in (ROOT / "dags").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                assert module.split(".")[0] in {"__future__", "airflow", "tasks", "retrainer_airflow", "logging", "os",
                                                "datetime", "pathlib"}, f"{path.name}: {line}"
