"""Who an Airflow run acts for, as the registry's audit trail names it (tasks.base.audit joins the parts).

A run a person started (the UI's trigger button, the REST API, `airflow dags trigger`) carries that
person on its DagRun (`triggering_user_name`); a scheduled or data-triggered run carries nobody and is
named by itself alone.
"""

from __future__ import annotations

from typing import Any

from tasks.base.audit import via


def run_name(context: Any) -> str:
    """`airflow <dag_id>/<run_id>`: the run, as the registry page links it back to the Airflow UI."""
    ti = context["ti"]
    return f"airflow {ti.dag_id}/{ti.run_id}"


def triggering_user(context: Any) -> str | None:
    """The person who started this run, or None for a run nobody started by hand."""
    return getattr(context["dag_run"], "triggering_user_name", None) or None


def run_actor(context: Any) -> str:
    """`alice via airflow rollback_model/<run>` for a run alice triggered; `airflow <dag>/<run>` otherwise."""
    return via(triggering_user(context), run_name(context))
