"""Every DAG imports cleanly, with no deprecated Airflow imports, and is wired as designed."""

from __future__ import annotations

import itertools
import warnings
from datetime import timedelta
from pathlib import Path

from tasks import REPO_ROOT

ROOT = REPO_ROOT


def _dagbag():
    from airflow.dag_processing.dagbag import DagBag

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return DagBag(dag_folder=str(ROOT / "dags"))


def test_dagbag_imports_without_errors_or_deprecations(airflow_db: str) -> None:
    bag = _dagbag()
    assert bag.import_errors == {}
    assert {"retrain_tiny-llama", "rollback_model", "promote_model"} <= set(bag.dag_ids)


def test_promote_dag_runs_the_gate_then_the_approval_then_the_move(airflow_db: str) -> None:
    dag = _dagbag().get_dag("promote_model")
    for upstream, downstream in itertools.pairwise(["check", "evaluate", "gate", "approval", "promote"]):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    assert set(dag.params.keys()) == {"model", "version", "alias", "force", "reason"}
    approval = dag.get_task("approval")
    assert approval.options == ["Approve", "Reject"] and approval.defaults == ["Reject"]


def test_retrain_dag_shape(airflow_db: str) -> None:
    dag = _dagbag().get_dag("retrain_tiny-llama")
    assert dag.max_active_runs == 1
    order = ["plan", "new_data", "warm", "not_dry_run", "train", "evaluate", "gate", "approval", "publish",
             "housekeeping"]
    for upstream, downstream in itertools.pairwise(order):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    assert dag.get_task("train").retries >= 1
    assert dag.get_task("evaluate").retries >= 2  # a resumed try can be lost to Airflow's stale exit event, twice
    # Retries come within seconds (Airflow's default waits 5 minutes): a deferred try may lose a stale-event race.
    assert all(dag.get_task(t).retry_delay.total_seconds() <= 10 for t in ("train", "evaluate"))
    # Evaluation runs as ranks on the training cluster: it takes the same pool, sized by its own layout.
    train, evaluate = dag.get_task("train"), dag.get_task("evaluate")
    assert train.pool == evaluate.pool == "training-local" and train.pool_slots == evaluate.pool_slots == 2
    assert set(dag.params.keys()) >= {"steps", "tp", "pp", "dp", "alias", "dry_run", "force"}
    # The approval step is Airflow's own (its REST endpoints answer it); timing out means Reject.
    approval = dag.get_task("approval")
    assert approval.options == ["Approve", "Reject"] and approval.defaults == ["Reject"]
    assert list(approval.params.keys()) == ["comment"]  # the form a person fills is its own, not the run's
    assert approval.params.get_param("comment").schema["type"] == ["null", "string"]  # optional: buttons enabled
    # Retries for Airflow 3.3.2's stale-exit race (operators.PublishApproval), a few seconds apart.
    assert approval.retries == 2 and approval.retry_delay.total_seconds() == 2
    assert dag.deadline is None  # the demo config sets no train.deadline


def test_train_deadline_becomes_the_retrain_dags_deadline_alert(airflow_db: str, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The scheduler gets it through the serialized DAG: the alert's callback must survive that."""
    import importlib.util
    import sys

    import yaml
    from airflow.sdk import DeadlineReference
    from airflow.serialization.serialized_objects import DagSerialization

    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["train"]["deadline"] = "1d12h"
    (tmp_path / "tiny-llama.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("retrainer_dagbag_deadline", ROOT / "dags" / "retrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    dag = module.__dict__["retrain_tiny-llama"]

    [alert] = dag.deadline
    assert alert.reference == DeadlineReference.DAGRUN_QUEUED_AT and alert.interval == timedelta(hours=36)
    assert alert.callback.path == "tasks.base.alerts.deadline_missed"  # importable by the triggerer
    assert alert.callback.kwargs == {"deadline": "1 day 12 hours"}
    serialized = DagSerialization.to_dict(dag)
    assert "tasks.base.alerts.deadline_missed" in str(serialized)


def test_deadline_alert_names_the_run_and_the_limit() -> None:
    import asyncio
    import logging

    from tasks.base.alerts import deadline_missed

    context = {"dag_run": {"dag_id": "retrain_tiny-llama", "dag_run_id": "manual__1", "state": "running",
                           "queued_at": "2026-03-01T02:00:00Z"},
               "deadline": {"deadline_time": "2026-03-02T14:00:00Z"}}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tasks.base.alerts").addHandler(handler)
    try:
        asyncio.run(deadline_missed(deadline="1 day 12 hours", context=context))
    finally:
        logging.getLogger("tasks.base.alerts").removeHandler(handler)
    [record] = records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "retrainer: retrain_tiny-llama run manual__1 missed its deadline: not done 1 day 12 hours "
        "(train.deadline) after it was queued at 2026-03-01T02:00:00Z (due 2026-03-02T14:00:00Z); state running")


def test_dags_hold_no_business_logic() -> None:
    """dags/ may only wire: it imports airflow.sdk, tasks and the plugins' Airflow glue (retrainer_airflow: the
    rank-job operator and trigger) and the typing/context-manager helpers wiring uses, nothing that computes."""
    for path in (ROOT / "dags").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                assert module.split(".")[0] in {"__future__", "airflow", "tasks", "retrainer_airflow", "logging", "os",
                                                "datetime", "pathlib", "collections", "contextlib"}, \
                    f"{path.name}: {line}"
