"""The example data producer through real `dag.test()`: a snapshot under a new prefix and an Asset event
on the job's `data.asset` whose extra names it (what starts a data-arrival retrain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dags.test_lifecycle_e2e import load_dag_module, run_dag, write_config


def test_publish_dataset_writes_a_snapshot_and_announces_it(
    tmp_path: Path, airflow_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    config = write_config(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    producer = load_dag_module("publish_dataset", monkeypatch, config.parent).publish_dataset_dag
    run = run_dag(producer, {"job": "tiny-llama", "seed": 5})
    assert run.state == "success"

    with create_session() as session:
        events = session.scalars(select(AssetEvent).join(AssetModel, AssetModel.id == AssetEvent.asset_id).where(
            AssetModel.uri == "retrainer-data://tiny-llama/", AssetEvent.source_run_id == run.run_id)).all()
        assert len(events) == 1
        extra = dict(events[0].extra)
    snapshot = Path(extra["source_url"])
    assert snapshot.parent == tmp_path / "store" / "data-snapshots"
    manifest = (snapshot / "manifest.json").read_bytes()
    assert json.loads(manifest)["files"]
    from tasks.base.dataset_format import manifest_hash

    assert extra["manifest_hash"] == manifest_hash(manifest)
