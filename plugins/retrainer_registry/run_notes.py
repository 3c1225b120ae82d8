"""Listener: a retrain run's outcome note (e.g. the gate's refusal) becomes the DAG run's note.

A task cannot set its own run's note in Airflow 3, so the gate pushes the reason as the XCom
`run_note`, and this listener (run where the run's state changes: the scheduler, or `dag.test()`)
copies it into the run's note, where the UI shows it on the run.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)

RUN_NOTE_KEY = "run_note"


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _copy_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _copy_note(dag_run)


def _copy_note(dag_run) -> None:
    if not dag_run.dag_id.startswith("retrain_"):
        return
    from airflow.models.dagrun import DagRun, DagRunNote
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.execute(
            select(XComModel).where(XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id,
                                    XComModel.key == RUN_NOTE_KEY)
        ).scalars().first()
        if row is None:
            return
        note = str(XComModel.deserialize_value(row))[:1000]
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_run.dag_id,
                                                   DagRun.run_id == dag_run.run_id)).one()
        if run.dag_run_note is None:
            run.dag_run_note = DagRunNote(content=note)
        else:
            run.dag_run_note.content = note
    log.info("retrainer: run %s/%s note: %s", dag_run.dag_id, dag_run.run_id, note)
