"""publish_dataset: an example producer of new training data, the upstream side of data-arrival retraining.

It writes a dataset snapshot (the demo's `make-data` corpus; a real producer would run its own ETL and
`retrainer manifest URL`) under a new prefix and emits an event on the job's `data.asset` whose extra
`source_url` names that prefix. The job's `retrain_<name>` DAG, scheduled on that Asset, starts a run
that warms and trains on exactly that snapshot (its lineage records the URL). Any system can send the
same event through Airflow's REST API: `POST /api/v2/assets/events` with
`{"asset_id": ..., "extra": {"source_url": "s3://bucket/corpus/2026-12-01/"}}`.
"""

from __future__ import annotations

from airflow.sdk import Asset, AssetAlias, Param, dag, get_current_context, task
from retrainer_airflow.configs import job_configs

from tasks.data.synthetic import write_snapshot as write_synthetic_snapshot  # the task's name is write_snapshot
from tasks.models.resolve import load_config

DATA_EVENTS = AssetAlias("retrainer-data-arrived")
PRODUCED = {cfg.name: path for path, cfg in job_configs().items() if cfg.data.asset}


@dag(
    dag_id="publish_dataset",
    schedule=None,
    catchup=False,
    tags=["retrainer"],
    doc_md=__doc__,
    params={
        "job": Param(next(iter(PRODUCED), ""), type="string", enum=sorted(PRODUCED) or [""],
                     description="job whose data.asset announces the snapshot"),
        "seed": Param(1, type="integer", minimum=0, description="seed of the synthetic corpus"),
        "dest_url": Param(None, type=["null", "string"], minLength=1, maxLength=1500,
                          description="snapshot prefix (default: <data.source_url>-snapshots/<run stamp>)"),
    },
)
def publish_dataset():
    @task(outlets=[DATA_EVENTS])
    def write_snapshot(*, outlet_events=None) -> dict:
        ctx = get_current_context()
        params = ctx["params"]
        cfg = load_config(PRODUCED[params["job"]])
        snap = write_synthetic_snapshot(cfg, seed=params["seed"], dest_url=params["dest_url"])
        outlet_events[DATA_EVENTS].add(Asset(cfg.data.asset), extra=snap)
        return snap

    write_snapshot()


publish_dataset_dag = publish_dataset()
