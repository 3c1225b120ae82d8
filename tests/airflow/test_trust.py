"""Who may move `production`, replayed by people of each Airflow role on the package's real `airflow standalone`.

The model's policy (the README's example): production needs an approval from alice, and only `op`s (and admins)
may move it by hand; staging needs nothing. In file order, as the attacker of issue 37 tried it and as a team
would then do it properly:
user1 (role `user`) retrains production: alice approves, v1 is live. user1 retrains staging with more steps:
v2, on staging only. user1 "rolls production back" to v2: refused, not a mover. op1, a mover, tries the same,
forced: refused by the registry, v2 was never live on production (a rollback only goes back), naming the
promote path. A viewer cannot even start promote_model. user1 starts promote_model for v2: its gate scores
v2 against production's v1, the approval waits for alice (Airflow refuses user1's own answer), alice
approves, and production moves to v2, recorded as a promotion under alice. Finally op1 rolls production back:
to v1, which it held, and that is allowed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.airflow.conftest import Standalone, Tenant

MODEL, ALIAS = "guarded-llama", "production"
RETRAIN, ROLLBACK, PROMOTE = f"retrain_{MODEL}", "rollback_model", "promote_model"

pytestmark = pytest.mark.multiproc


def _guarded(cfg: dict[str, Any]) -> None:
    cfg["publish"]["policy"] = {ALIAS: {"approval": "required", "approvers": ["alice"], "movers": ["role:op"]}}
    cfg["publish"]["approval_timeout_s"] = 600


TENANT = Tenant(models={MODEL: _guarded}, dag_ids=(RETRAIN, ROLLBACK, PROMOTE))


def _registry(sa: Standalone):
    from tasks.models.resolve import load_config
    from tasks.registry import Registry

    return Registry(load_config(sa.config_path(MODEL)).publish.registry_url)


def _start(sa: Standalone, dag_id: str, conf: dict[str, Any], user: str) -> str:
    resp = sa.trigger(dag_id, conf, user=user)
    assert resp.status_code == 200, resp.text
    return resp.json()["dag_run_id"]


def _hitl(dag_id: str, run_id: str) -> str:
    return f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/approval/-1/hitlDetails"


def _waiting(sa: Standalone, dag_id: str, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """The run's approval request, once it waits for a person."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sa.client(user="alice") as c:
            resp = c.get(_hitl(dag_id, run_id))
            if resp.status_code == 200 and not resp.json()["response_received"]:
                return resp.json()
        states = sa.task_states(dag_id, run_id)
        assert not {"failed", "upstream_failed"} & set(states.values()), (states, sa.log_tail())
        time.sleep(0.5)
    raise AssertionError(f"{dag_id} run {run_id} never waited for approval:\n{sa.log_tail()}")


def _answer(sa: Standalone, dag_id: str, run_id: str, user: str, option: str = "Approve") -> Any:
    with sa.client(user=user) as c:
        return c.patch(_hitl(dag_id, run_id), json={"chosen_options": [option], "params_input": {"comment": "ok"}})


def _finished(sa: Standalone, dag_id: str, run_id: str, state: str = "success") -> dict[str, Any]:
    run = sa.wait_run(dag_id, run_id)
    assert run["state"] == state, (sa.task_states(dag_id, run_id), run.get("note"), sa.log_tail())
    return run


def test_a_user_retrains_production_through_alice_and_staging_on_its_own(standalone: Standalone) -> None:
    run_id = _start(standalone, RETRAIN, {}, "user1")
    request = _waiting(standalone, RETRAIN, run_id)
    assert request["assigned_users"] == [{"id": "alice", "name": "alice"}]
    assert _answer(standalone, RETRAIN, run_id, "op1").status_code == 403  # an op, but not production's approver
    assert _answer(standalone, RETRAIN, run_id, "alice").status_code == 200
    _finished(standalone, RETRAIN, run_id)
    staged = _start(standalone, RETRAIN, {"alias": "staging", "steps": 6}, "user1")
    _finished(standalone, RETRAIN, staged)
    registry = _registry(standalone)
    assert registry.live_version(MODEL, ALIAS).version == 1 and registry.live_version(MODEL, "staging").version == 2
    assert registry.live_version(MODEL, ALIAS).created_by == f"alice via airflow {RETRAIN}/{run_id}"


def test_a_rollback_to_a_version_production_never_held_is_refused_for_a_user_and_a_mover(
        standalone: Standalone) -> None:
    registry = _registry(standalone)
    before = registry.history(MODEL, ALIAS)
    conf = {"model": MODEL, "alias": ALIAS, "to_version": 2, "force": True, "reason": "staging looks better"}
    as_user = _finished(standalone, ROLLBACK, _start(standalone, ROLLBACK, conf, "user1"), "failed")
    assert as_user["note"] == ("rollback: user1 (role user, viewer) may not roll back 'production': "
                               "publish.policy.production.movers is [role:op]")
    as_mover = _finished(standalone, ROLLBACK, _start(standalone, ROLLBACK, conf, "op1"), "failed")
    assert as_mover["note"].startswith(f"rollback: model '{MODEL}' alias 'production': version 2 was never live on "
                                       "it (it held: v1); a rollback only goes back."), as_mover["note"]
    assert "promote_model" in as_mover["note"]
    assert registry.history(MODEL, ALIAS) == before and registry.live_version(MODEL, ALIAS).version == 1


def test_a_viewer_cannot_start_a_promotion_and_a_user_s_goes_through_the_gate_and_alice(
        standalone: Standalone) -> None:
    conf = {"model": MODEL, "version": 2, "alias": ALIAS, "reason": "staging v2 is better"}
    assert standalone.trigger(PROMOTE, conf, user="viewer1").status_code == 403
    run_id = _start(standalone, PROMOTE, conf, "user1")
    request = _waiting(standalone, PROMOTE, run_id)
    assert request["subject"] == f"Promote {MODEL} v2 to {ALIAS}?"
    assert "**Gate**: passed:" in request["body"] and "| metric | v2 | live | change |" in request["body"]
    refused = _answer(standalone, PROMOTE, run_id, "user1")  # the requester approving their own promotion
    assert refused.status_code == 403 and "is not a respondent" in refused.text
    assert _answer(standalone, PROMOTE, run_id, "alice").status_code == 200
    run = _finished(standalone, PROMOTE, run_id)
    assert run["note"] == f"promoted {MODEL} v2 onto {ALIAS} (was v1)"
    registry = _registry(standalone)
    move = registry.history(MODEL, ALIAS)[-1]
    assert (move.action, move.from_version, move.to_version) == ("promote", 1, 2)
    assert move.actor == f"alice via airflow {PROMOTE}/{run_id}"
    assert move.reason.startswith("staging v2 is better; gate: ") and move.reason.endswith("; approved by alice: ok")


def test_a_mover_rolls_production_back_to_what_it_held(standalone: Standalone) -> None:
    run_id = _start(standalone, ROLLBACK, {"model": MODEL, "alias": ALIAS, "reason": "v2 answers worse"}, "op1")
    _finished(standalone, ROLLBACK, run_id)
    move = _registry(standalone).history(MODEL, ALIAS)[-1]
    assert (move.action, move.from_version, move.to_version, move.actor) == (
        "rollback", 2, 1, f"op1 via airflow {ROLLBACK}/{run_id}")
