"""Human approval before production and the deadline alert, under one real `airflow standalone`.

The config requires approval for `production` only (`publish.approval: {production: required}`), gives a
person 60 s to answer, and sets `train.deadline: 20s`. All four runs train on the same data from the same
starting point (nothing is live on either alias when they start), so only the first one trains; the others
reuse its checkpoint and evaluate again. In file order, sharing the standalone, as a user would:
nobody answers the first run in time (rejected, noted, nothing published; its deadline alert fires);
the second is rejected through the HITL REST endpoint with a comment (the run's note says who and why);
the third is approved through it (published, the approver in the version's created_by and the alias
history); a run to `staging`, which needs no approval, publishes at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.airflow.conftest import Standalone, run_standalone

RETRAIN = "retrain_tiny-llama"
MODEL, ALIAS = "tiny-llama", "production"
TIMEOUT_S = 60

pytestmark = pytest.mark.multiproc


def _requires_approval(cfg: dict[str, Any]) -> None:
    cfg["publish"].update(approval={ALIAS: "required"}, approval_timeout_s=TIMEOUT_S)
    cfg["train"]["deadline"] = "20s"


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with run_standalone(tmp_path_factory, _requires_approval) as sa:
        with sa.client() as c:
            c.patch(f"/api/v2/dags/{RETRAIN}", json={"is_paused": False}).raise_for_status()
        yield sa


def _registry(sa: Standalone):
    from tasks.config import load_config
    from tasks.registry import Registry

    return Registry(load_config(sa.config_path).publish.registry_url)


def _hitl_path(run_id: str) -> str:
    return f"/api/v2/dags/{RETRAIN}/dagRuns/{run_id}/taskInstances/approval/-1/hitlDetails"


def _start(sa: Standalone, conf: dict[str, Any] | None = None) -> str:
    resp = sa.trigger(RETRAIN, conf or {})
    assert resp.status_code == 200, resp.text
    return resp.json()["dag_run_id"]


def _awaiting_approval(sa: Standalone, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """The approval request as a person's client sees it, once the run waits for an answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = sa.task_states(RETRAIN, run_id)
        # And the scheduler has taken the waiting task's exit: Airflow 3.3.2 fails a task whose stale "success"
        # exit event it processes after an answer already queued it again (fixed upstream, apache/airflow#67330).
        if states.get("approval") == "awaiting_input" and _exit_seen(sa, run_id):
            with sa.client() as c:
                return c.get(_hitl_path(run_id)).raise_for_status().json()
        assert not {"failed", "upstream_failed"} & set(states.values()), (states, sa.log_tail())
        assert states.get("approval") not in ("success", "skipped"), states
        time.sleep(2)
    raise AssertionError(f"run {run_id} never waited for approval:\n{sa.log_tail()}")


def _exit_seen(sa: Standalone, run_id: str) -> bool:
    event = (f"Received executor event with state success for task instance TaskInstanceKey(dag_id='{RETRAIN}', "
             f"task_id='approval', run_id='{run_id}'")
    return event in sa.log_path.read_text(errors="replace")


def _answer(sa: Standalone, run_id: str, option: str, comment: str) -> dict[str, Any]:
    with sa.client() as c:
        resp = c.patch(_hitl_path(run_id), json={"chosen_options": [option], "params_input": {"comment": comment}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _finished(sa: Standalone, run_id: str) -> dict[str, Any]:
    run = sa.wait_run(RETRAIN, run_id)
    assert run["state"] == "success", sa.task_states(RETRAIN, run_id)
    return run


def _poll_log(sa: Standalone, text: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in sa.log_path.read_text(errors="replace").splitlines():
            if text in line:
                return line
        time.sleep(2)
    raise AssertionError(f"no log line with {text!r} in {timeout}s:\n{sa.log_tail()}")


def test_no_answer_in_time_rejects_and_the_deadline_alert_fires(standalone: Standalone) -> None:
    run_id = _start(standalone)
    request = _awaiting_approval(standalone, run_id)
    assert request["options"] == ["Approve", "Reject"] and request["defaults"] == ["Reject"]
    assert request["subject"] == f"Publish the new {MODEL} to {ALIAS}?"
    body = request["body"]
    for text in ("`heldout.loss`", "`heldout.perplexity`", "| metric | candidate | live | change |",
                 f"Live on `{ALIAS}`: nothing yet", "**Gate**: passed:", "- passed: evaluate.gate.rules[0]",
                 "No answer within 0:01:00 rejects it."):
        assert text in body, (text, body)

    run = _finished(standalone, run_id)  # nobody answers: the scheduler's timeout sweep applies Reject
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "skipped"
    assert run["note"] == ("approval: nobody answered within 0:01:00 (publish.approval_timeout_s): timed out, "
                           "rejected; not published")
    assert _registry(standalone).models() == []  # nothing published, no alias

    # The run overran train.deadline (20 s) long before it finished: the triggerer logged the alert.
    line = _poll_log(standalone, f"run {run_id} missed its deadline")
    assert "not done 0:00:20 (train.deadline) after it was queued at" in line


def test_reject_through_rest_publishes_nothing_and_notes_who_and_why(standalone: Standalone) -> None:
    run_id = _start(standalone)
    _awaiting_approval(standalone, run_id)
    answered = _answer(standalone, run_id, "Reject", "perplexity too close to live, wait for more data")
    assert answered["responded_by"]["name"] == "admin"

    run = _finished(standalone, run_id)
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "skipped"
    assert run["note"] == ("approval: rejected by admin: perplexity too close to live, wait for more data; "
                           "not published")
    registry = _registry(standalone)
    assert registry.models() == [] and registry.live_version(MODEL, ALIAS) is None
    assert "reusing it, no training" in standalone.task_log(RETRAIN, run_id, "train")  # one training in all


def test_approve_through_rest_publishes_and_names_the_approver(standalone: Standalone) -> None:
    run_id = _start(standalone)
    _awaiting_approval(standalone, run_id)
    _answer(standalone, run_id, "Approve", "numbers look right")

    run = _finished(standalone, run_id)
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "success"
    assert run["note"] is None
    registry = _registry(standalone)
    live = registry.live_version(MODEL, ALIAS)
    assert live is not None and live.version == 1
    assert live.created_by == f"admin via airflow {RETRAIN}/{run_id}"
    [move] = registry.history(MODEL, ALIAS)
    assert (move.action, move.from_version, move.to_version) == ("publish", None, 1)
    assert move.actor == live.created_by and move.reason == "retrain, approved by admin: numbers look right"


def test_an_alias_that_needs_no_approval_publishes_at_once(standalone: Standalone) -> None:
    run_id = _start(standalone, {"alias": "staging"})  # publish.approval lists production only
    _finished(standalone, run_id)
    states = standalone.task_states(RETRAIN, run_id)
    assert states["approval"] == "success" and states["publish"] == "success", states
    with standalone.client() as c:
        assert c.get(_hitl_path(run_id)).status_code == 404  # nobody was asked
    assert "needs no approval" in standalone.task_log(RETRAIN, run_id, "approval")
    registry = _registry(standalone)
    assert registry.live_version(MODEL, "staging").version == 1  # the same weights as production's v1
    [move] = registry.history(MODEL, "staging")
    assert move.actor == f"admin via airflow {RETRAIN}/{run_id}" and move.reason == "retrain"  # who triggered it
