"""End to end through real Airflow `dag.test()` on PostgreSQL: the weekly retrain a platform team runs.

Same config every week (the demo's, shrunk: `init_from: live`), new data at the same URL, a rollback
through the `rollback_model` DAG, the schedule firing again after it, then new data again. Real parts
throughout: the DAGs, torchrun + DeepSpeed ranks on gloo, the registry database, the local-folder
object store. The assertions are what a user checks: did it train, from what, what is live, which
Asset events fired. (The same sequence through the CLI on SQLite: tests/test_weekly_retrain.py.)
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tests.services import free_port

ROOT = REPO_ROOT


def write_config(tmp: Path, registry_url: str) -> Path:
    """The demo config, shrunk: same model family, a few steps, its own port and folders."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32)
    cfg["train"].update(steps=4, checkpoint_every=2, micro_batch_size=4, warmup_steps=0,
                        output_dir=str(tmp / "runs"))
    cfg["data"].update(source_url=str(tmp / "store" / "data"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=4)
    cfg["evaluate"]["gate"]["tolerance"] = 0.0
    cfg["publish"].update(registry_url=registry_url, store_url=str(tmp / "store" / "models"))
    # dag.test() runs as the user "dag_test" (no role of this Airflow): production's movers name it, as a team
    # names a person, so its rollback_model run may move production.
    cfg["publish"]["policy"] = {"production": {"movers": ["role:op", "dag_test"]}}
    config_dir = tmp / "configs"
    config_dir.mkdir()
    path = config_dir / "tiny-llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def load_dag_module(name: str, monkeypatch: pytest.MonkeyPatch, config_dir: Path):
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(config_dir))
    spec = importlib.util.spec_from_file_location(f"test_{name}", ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_dag(dag, conf: dict | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FIELD-NOTES: a starlette warning turned error fails dag.test()
        return dag.test(run_conf=conf or {})


def model_events(uri: str) -> int:
    """How many Asset events Airflow recorded for `uri` (the alias-moved events a deploy DAG consumes)."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return session.scalar(select(func.count()).select_from(AssetEvent).join(
            AssetModel, AssetModel.id == AssetEvent.asset_id).where(AssetModel.uri == uri))


def weekly_retrain(tmp_path: Path, registry_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.data.synthetic import make_data
    from tasks.registry import Registry, upgrade

    upgrade(registry_url)  # what `retrainer db upgrade` (the compose init service) does before any run
    config = write_config(tmp_path, registry_url)
    data_url = str(tmp_path / "store" / "data")
    retrain = load_dag_module("retrain", monkeypatch, config.parent).__dict__["retrain_tiny-llama"]
    rollback = load_dag_module("rollback", monkeypatch, config.parent).rollback_dag
    registry = Registry(registry_url)
    uri = "model://tiny-llama/production"
    events = model_events(uri)

    def week(seed: int) -> None:
        make_data(data_url, name="tiny-llama", seed=seed, n_train_shards=2, tokens_per_shard=16384)

    week(11)
    first = run_dag(retrain)
    assert first.state == "success"
    v1 = registry.live_version("tiny-llama", "production")
    assert v1.version == 1 and v1.parent_version is None
    assert model_events(uri) == events + 1

    week(22)  # new data at the same URL, the same config and form values
    second = run_dag(retrain)
    assert second.state == "success"
    v2 = registry.live_version("tiny-llama", "production")
    assert v2.version == 2 and v2.parent_version == 1 and v2.init_digest == v1.artifact_digest
    assert v2.data_manifest_hash != v1.data_manifest_hash and v2.artifact_digest != v1.artifact_digest
    summary = xcom(second, "train")
    assert summary["outcome"] == "trained" and summary["trained_steps"] == summary["steps"] == 4
    assert summary["started_from"] == "tiny-llama v1 (live on production)"
    assert model_events(uri) == events + 2

    back = run_dag(rollback, {"model": "tiny-llama", "reason": "regression in prod"})
    assert back.state == "success"
    assert registry.live_version("tiny-llama", "production").version == 1
    assert model_events(uri) == events + 3

    # The schedule fires again on week 2's data: that run is v2 again, which an operator rolled back.
    again = run_dag(retrain)
    assert again.state == "success"
    # Refused at plan, with the gate's words: its result is v2 (same key), so nothing is warmed, trained or
    # evaluated.
    assert {t: run_state(again, t) for t in ("warm", "train", "evaluate", "gate", "publish")} == dict.fromkeys(
        ("warm", "train", "evaluate", "gate", "publish"), "skipped")
    note = run_note(again)
    assert note.startswith("gate: candidate is tiny-llama v2"), note
    assert "rolled back from production" in note and "regression in prod" in note
    assert registry.live_version("tiny-llama", "production").version == 1
    assert len(registry.list_versions("tiny-llama")) == 2
    assert model_events(uri) == events + 3  # nothing moved, so no event

    week(33)
    third = run_dag(retrain)
    assert third.state == "success"
    v3 = registry.live_version("tiny-llama", "production")
    assert v3.version == 3 and v3.parent_version == 1
    history = [(h.action, h.from_version, h.to_version) for h in registry.history("tiny-llama", "production")]
    assert history == [("publish", None, 1), ("publish", 1, 2), ("rollback", 2, 1), ("publish", 1, 3)]
    assert model_events(uri) == events + 4


def xcom(dag_run, task_id: str):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(select(XComModel).where(
            XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id, XComModel.task_id == task_id,
            XComModel.key == "return_value")).one()
        return XComModel.deserialize_value(row)


def run_state(dag_run, task_id: str) -> str:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalars(select(TaskInstance.state).where(
            TaskInstance.dag_id == dag_run.dag_id, TaskInstance.run_id == dag_run.run_id,
            TaskInstance.task_id == task_id)).one()


def run_note(dag_run) -> str:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_run.dag_id,
                                                   DagRun.run_id == dag_run.run_id)).one()
        return run.note or ""


@pytest.mark.multiproc
def test_weekly_retrain_through_dag_test_on_postgres(tmp_path: Path, airflow_db: str, pg_url: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    weekly_retrain(tmp_path, pg_url, monkeypatch)
