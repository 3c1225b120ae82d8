"""Listener: a retrain, rollback or promote run's outcome note (the gate's or the plan's refusal, a refused conf)
becomes the DAG run's note.

A task cannot set its own run's note in Airflow 3, so the task pushes the reason as the XCom
`run_note`, and this listener (run where the run's state changes: the scheduler, or `dag.test()`)
copies it into the run's note, where the UI shows it on the run.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl
from retrainer_airflow.contract import RUN_NOTE_KEY

log = logging.getLogger(__name__)

NOTED_DAGS = ("retrain_", "rollback_model", "promote_model", "deploy_")  # dag id prefixes whose runs may carry a note


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _copy_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _copy_note(dag_run)


def _copy_note(dag_run) -> None:
    """In the scheduler the run is bound to the scheduler's session, inside its critical section: read
    and write through that session and let the scheduler commit (committing it ourselves breaks the
    scheduler's HA locks). An unbound run (`dag.test()`) gets a short session of its own."""
    if not dag_run.dag_id.startswith(NOTED_DAGS):
        return
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is not None:
        _set_note(session, dag_run)
        return
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as own:
        run = own.scalars(select(DagRun).where(DagRun.dag_id == dag_run.dag_id,
                                               DagRun.run_id == dag_run.run_id)).one()
        _set_note(own, run)


def _set_note(session, dag_run) -> None:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    row = session.scalars(
        select(XComModel).where(XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id,
                                XComModel.key == RUN_NOTE_KEY)
    ).first()
    if row is None:
        return
    note = str(XComModel.deserialize_value(row))[:1000]
    dag_run.note = note
    log.info("retrainer: run %s/%s note: %s", dag_run.dag_id, dag_run.run_id, note)
