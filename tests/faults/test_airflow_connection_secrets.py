"""The registry's DB password, handed over as an Airflow Connection (`AIRFLOW_CONN_RETRAINER_REGISTRY`,
referenced by the job config as `${AIRFLOW_CONN_RETRAINER_REGISTRY}`), never reaches the Airflow task
logs, the run's XComs, the run's files, or the registry's records, through a real `dag.test()` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tasks import REPO_ROOT
from tasks.data.synthetic import make_data
from tests.dags.test_lifecycle_e2e import load_dag_module, run_dag, write_config
from tests.services import PgCluster

pytestmark = pytest.mark.multiproc

ROOT = REPO_ROOT
TEXT_SUFFIXES = {".json", ".jsonl", ".log", ".txt", ".yaml", ".yml", ""}


def text_files(root: Path) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in root.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and p.stat().st_size < 50_000_000}


def run_xcoms(dag_run) -> list[str]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.dag_id == dag_run.dag_id,
                                                       XComModel.run_id == dag_run.run_id)).all()
        return [f"{r.task_id} {r.key} {r.value!r}" for r in rows]


def test_db_password_from_an_airflow_connection_never_leaks(
    tmp_path: Path, airflow_db: str, pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    password = f"s3cr3t-{uuid.uuid4().hex}"
    db = make_url(pg_cluster.create_database()).database
    uri = f"postgresql://postgres:{password}@127.0.0.1:{pg_cluster.port}/{db}"
    from tasks.registry import upgrade

    upgrade(uri)  # the deployment's `retrainer db upgrade`
    monkeypatch.setenv("AIRFLOW_CONN_RETRAINER_REGISTRY", uri)

    # It is an Airflow Connection: Airflow's secrets lookup finds it, with this password.
    from airflow.models.connection import Connection

    conn = Connection.get_connection_from_secrets("retrainer_registry")
    assert (conn.login, conn.password, conn.host, conn.port, conn.schema) == (
        "postgres", password, "127.0.0.1", pg_cluster.port, db)

    config = write_config(tmp_path, "${AIRFLOW_CONN_RETRAINER_REGISTRY}")
    assert password not in config.read_text()
    make_data(str(tmp_path / "store" / "data"), name="tiny-llama", n_train_shards=2, tokens_per_shard=16384)
    retrain = load_dag_module("retrain", monkeypatch, config.parent).__dict__["retrain_tiny-llama"]
    logs = Path(os.environ["AIRFLOW_HOME"]) / "logs"
    before = set(text_files(logs)) if logs.is_dir() else set()

    dag_run = run_dag(retrain, {"steps": 2})
    assert dag_run.state == "success"
    captured = capfd.readouterr()

    # The run really used the registry behind the Connection.
    from tasks.registry import Registry

    registry = Registry(pg_cluster.url(db))
    assert registry.live_version("tiny-llama", "production").version == 1

    show = subprocess.run([sys.executable, "-m", "tasks.cli", "registry", "show", "--model", "tiny-llama", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, RETRAINER_DB_URL=uri))
    assert show.returncode == 0, show.stderr[-3000:]
    assert json.loads(show.stdout)

    places: dict[str, str] = {"task output (stdout/stderr)": captured.out + captured.err,
                              "registry show --json": show.stdout + show.stderr}
    new_logs = {p: t for p, t in text_files(logs).items() if p not in before} if logs.is_dir() else {}
    places.update({str(p): t for p, t in new_logs.items()})
    xcoms = run_xcoms(dag_run)
    assert any(x.startswith("evaluate ") for x in xcoms), xcoms
    places.update({f"xcom {x[:40]}": x for x in xcoms})
    run_files = text_files(tmp_path)
    assert any(p.name == "summary.json" for p in run_files), sorted(map(str, run_files))
    places.update({str(p): t for p, t in run_files.items()})
    for where, text in places.items():
        assert password not in text, f"the DB password leaked into {where}"
    # The logs checked are the real task logs: dag.test() streams them to the process output (it writes
    # no files under $AIRFLOW_HOME/logs; any it did write were checked above).
    # (Which library loggers reach that stream depends on the logging set-up earlier tests left behind,
    # so the proof that task logs were captured is the task runner's own lines for the publish task.)
    task_logs = places["task output (stdout/stderr)"] + "".join(new_logs.values())
    assert "task_id='publish'" in task_logs and "Pushing xcom" in task_logs, task_logs[-3000:]
