"""What a newcomer meets triggering runs under the real scheduler (the package's `airflow standalone`, started by
the README's `retrainer airflow` lines): a misspelled conf key is refused at the trigger naming it, before any
run exists; a layout the form cannot judge (tp=3 for a model of 2 heads) fails in plan with the plan's
own reason as the run's note; `rollback_model` refuses an alias that is no name at the trigger.
"""

from __future__ import annotations

import pytest

from tests.airflow.conftest import Standalone, Tenant

MODEL = "ux-llama"
RETRAIN = f"retrain_{MODEL}"
ROLLBACK = "rollback_model"

pytestmark = pytest.mark.multiproc

TENANT = Tenant(models={MODEL: None}, dag_ids=(RETRAIN, ROLLBACK))


@pytest.mark.parametrize(("dag_id", "conf", "key"), [(RETRAIN, {"stpes": 10}, "stpes"),
                                                     (ROLLBACK, {"model": MODEL, "to_versoin": 1},
                                                      "to_versoin")])
def test_a_misspelled_conf_key_is_refused_at_the_trigger(standalone: Standalone, dag_id: str, conf: dict,
                                                         key: str) -> None:
    before = standalone.run_ids(dag_id)
    resp = standalone.trigger(dag_id, conf)
    assert resp.status_code == 400, resp.text
    detail = resp.json()["detail"]
    assert f"unknown conf key '{key}'" in detail and f"Invalid conf for {dag_id}" in detail, detail
    assert standalone.run_ids(dag_id) == before  # refused before a run existed

    # Someone Airflow would not let trigger learns nothing from it: Airflow's own refusal, not ours.
    with standalone.client(authenticated=False) as anon:
        resp = anon.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
    assert resp.status_code in (401, 403) and key not in resp.text, resp.text


def test_rollback_refuses_an_alias_that_is_no_name_at_the_trigger(standalone: Standalone) -> None:
    before = standalone.run_ids(ROLLBACK)
    resp = standalone.trigger(ROLLBACK, {"model": MODEL, "alias": "prod/blue"})
    assert resp.status_code == 400, resp.text
    assert "param alias" in resp.text, resp.text
    assert standalone.run_ids(ROLLBACK) == before


def test_a_layout_the_plan_refuses_fails_the_run_with_the_plans_reason_as_its_note(standalone: Standalone) -> None:
    from tasks.base.errors import ConfigError
    from tasks.models.resolve import load_config

    with pytest.raises(ConfigError) as refused:  # what `retrainer plan` says of this layout
        load_config(standalone.config_path(MODEL), {"parallel.tp": 3})
    with standalone.client() as c:
        c.patch(f"/api/v2/dags/{RETRAIN}", json={"is_paused": False}).raise_for_status()
    resp = standalone.trigger(RETRAIN, {"tp": 3})  # within the form's 1..64: accepted at the trigger
    assert resp.status_code == 200, resp.text
    run = standalone.wait_run(RETRAIN, resp.json()["dag_run_id"])
    assert run["state"] == "failed"
    states = standalone.task_states(RETRAIN, run["dag_run_id"])
    assert states["plan"] == "failed" and states["warm"] == "upstream_failed", states
    assert run["note"] == f"plan: {refused.value}", run["note"]
    assert "parallel.tp (3) must divide model.n_heads" in run["note"]
