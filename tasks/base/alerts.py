"""The deadline alert of a retrain run (`train.deadline`): one error line naming the run that overran.

Airflow's deadline alert calls `deadline_missed` in the triggerer, by import path, so it lives in an
importable module (a function of the DAG file is not importable there) and uses no Airflow API: the
context Airflow passes is plain JSON (the DAG run as the REST API shows it, and the deadline).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def deadline_line(context: dict[str, Any], deadline: str) -> str:
    """What whoever reads the alert at 3am needs: which run, which limit, since when, in what state."""
    run = context.get("dag_run") or {}
    due = (context.get("deadline") or {}).get("deadline_time")
    return (f"retrainer: {run.get('dag_id')} run {run.get('dag_run_id')} missed its deadline: not done "
            f"{deadline} (train.deadline) after it was queued at {run.get('queued_at')} (due {due}); "
            f"state {run.get('state')}")


async def deadline_missed(deadline: str, context: dict[str, Any] | None = None) -> None:
    """Airflow's deadline callback (an AsyncCallback, run by the triggerer)."""
    log.error("%s", deadline_line(context or {}, deadline))
