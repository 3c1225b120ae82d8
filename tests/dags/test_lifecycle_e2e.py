"""End to end through real Airflow `dag.test()`: retrain twice, roll back, on SQLite and PostgreSQL.

Real parts throughout: the DAGs, torchrun + DeepSpeed ranks on gloo, the registry database, the
local-folder object store. Step counts are tiny to keep CI fast; the assertions are on the registry.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp: Path, registry_url: str) -> Path:
    """The demo config, shrunk: same model family, a few steps, its own port and folders."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-gpt.yaml").read_text())
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32)
    cfg["train"].update(steps=4, checkpoint_every=2, micro_batch_size=4, warmup_steps=0,
                        output_dir=str(tmp / "runs"))
    cfg["data"].update(source_url=str(tmp / "store" / "data"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=4)
    cfg["evaluate"]["gate"]["tolerance"] = 0.0
    cfg["publish"].update(registry_url=registry_url, store_url=str(tmp / "store" / "models"))
    config_dir = tmp / "configs"
    config_dir.mkdir()
    path = config_dir / "tiny-gpt.yaml"
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


def lifecycle_twice_then_rollback(tmp_path: Path, registry_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.data import make_data
    from tasks.registry import Registry

    config = write_config(tmp_path, registry_url)
    make_data(str(tmp_path / "store" / "data"), name="tiny-gpt", n_train_shards=2, tokens_per_shard=16384)
    retrain = load_dag_module("retrain", monkeypatch, config.parent).__dict__["retrain_tiny-gpt"]
    rollback = load_dag_module("rollback", monkeypatch, config.parent).rollback_dag

    first = run_dag(retrain, {"steps": 4})
    assert first.state == "success"
    registry = Registry(registry_url)
    assert registry.live_version("tiny-gpt", "production").version == 1

    second = run_dag(retrain, {"steps": 12})
    assert second.state == "success"
    live = registry.live_version("tiny-gpt", "production")
    assert live.version == 2
    assert live.config_hash != registry.get_version("tiny-gpt", 1).config_hash

    back = run_dag(rollback, {"model": "tiny-gpt"})
    assert back.state == "success"
    assert registry.live_version("tiny-gpt", "production").version == 1

    history = [(h.from_version, h.to_version) for h in registry.history("tiny-gpt", "production")]
    assert history == [(None, 1), (1, 2), (2, 1)]

    # A worse model (one step) is stopped by the gate: publish skipped, alias unchanged, reason on the run.
    worse = run_dag(retrain, {"steps": 1})
    assert worse.state == "success"
    assert run_state(worse, "publish") == "skipped"
    assert registry.live_version("tiny-gpt", "production").version == 1
    assert len(registry.list_versions("tiny-gpt")) == 2
    assert "not published" in run_note(worse)


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
def test_lifecycle_on_sqlite(tmp_path: Path, airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle_twice_then_rollback(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}", monkeypatch)


@pytest.mark.multiproc
def test_lifecycle_on_postgres(tmp_path: Path, airflow_db: str, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle_twice_then_rollback(tmp_path, pg_url, monkeypatch)
