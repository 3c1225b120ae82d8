"""Human approval before production and the deadline alert, on the package's real `airflow standalone`.

The model is the README's `tiny-llama` (its REST lines start a run of it). Its config requires approval for
`production` only (`publish.approval: {production: required}`), gives a person 30 s to answer, and sets
`train.deadline: 20s`. All four runs train on the same data from the same starting point (nothing is live on
either alias when they start), so only the first one trains; the others reuse its checkpoint and evaluate
again. In file order, as a user would:
nobody answers the first run in time (rejected, noted, nothing published; its deadline alert fires);
the second is rejected through the HITL REST endpoint with a comment (the run's note says who and why) by
alice, an `op` (the default approvers, role:op), after Airflow refused an answer from admin, who started the
run (no self-approval), and from a `user`; the third, started by the README's REST lines as written, is
approved through it by alice (published, the approver in the version's created_by and the alias
history); a run to `staging`, which needs no approval, publishes at once. A person answers as soon as
the request is listed as waiting, which Airflow 3.3.2 may mishandle (apache/airflow#67330); the approval
is made to lose that race for certain, and its answer must stand anyway.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.airflow.conftest import Standalone, Tenant, under_airflow_bash_blocks

RETRAIN = "retrain_tiny-llama"
MODEL, ALIAS = "tiny-llama", "production"
TIMEOUT_S = 30  # the shortest that leaves a person's answer seconds to spare on a busy CI box
APPROVER = "alice"  # an `op`: the default approvers are role:op, and admin starts the runs (no self-approval)

pytestmark = pytest.mark.multiproc


def _requires_approval(cfg: dict[str, Any]) -> None:
    cfg["publish"].update(approval={ALIAS: "required"}, approval_timeout_s=TIMEOUT_S)
    cfg["train"]["deadline"] = "20s"


TENANT = Tenant(models={MODEL: _requires_approval}, dag_ids=(RETRAIN,))  # unpaused: `retrainer airflow` creates DAGs so


def _registry(sa: Standalone):
    from tasks.models.resolve import load_config
    from tasks.registry import Registry

    return Registry(load_config(sa.config_path(MODEL)).publish.registry_url)


def _hitl_path(run_id: str) -> str:
    return f"/api/v2/dags/{RETRAIN}/dagRuns/{run_id}/taskInstances/approval/-1/hitlDetails"


def _start(sa: Standalone, conf: dict[str, Any] | None = None) -> str:
    resp = sa.trigger(RETRAIN, conf or {})
    assert resp.status_code == 200, resp.text
    return resp.json()["dag_run_id"]


def _awaiting_approval(sa: Standalone, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """The approval request as a person's client sees it, as soon as the run's request is in the list of those
    waiting (the README's endpoint): a person answers at once, without waiting for the scheduler to take the
    waiting task's exit (Airflow 3.3.2 fails a task answered before that, apache/airflow#67330; its retry
    takes the recorded answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sa.client() as c:
            waiting = c.get("/api/v2/dags/~/dagRuns/~/hitlDetails",
                            params={"response_received": "false"}).raise_for_status().json()["hitl_details"]
            if any((w["task_instance"]["dag_id"], w["task_instance"]["dag_run_id"]) == (RETRAIN, run_id)
                   for w in waiting):
                return c.get(_hitl_path(run_id)).raise_for_status().json()
        states = sa.task_states(RETRAIN, run_id)
        assert not {"failed", "upstream_failed"} & set(states.values()), (states, sa.log_tail())
        assert states.get("approval") not in ("success", "skipped"), states
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} never waited for approval:\n{sa.log_tail()}")


def _start_as_the_readme_does(sa: Standalone) -> str:
    """The README's REST lines as written (a token from the password file, a run with `logical_date: null`),
    pointed at this standalone's port and AIRFLOW_HOME."""
    script = under_airflow_bash_blocks()[1].replace("http://localhost:8080", sa.base_url)
    script = script.replace("airflow-home/", sa.env["AIRFLOW_HOME"] + "/")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=sa.home, env=sa.env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    assert run["dag_id"] == RETRAIN and run["state"] == "queued", run
    return run["dag_run_id"]


# The scheduler's half of apache/airflow#67330, done to a waiting task a person has just answered: it takes the
# waiting try's stale exit event for a kill (TaskInstance.handle_failure, as the scheduler calls it). Fault
# injection, run against the standalone's metadata database in a process of its own (Airflow's configuration).
STALE_EXIT_EVENT = """
import sys
from sqlalchemy import select
from airflow.models.serialized_dag import SerializedDagModel
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session

dag_id, run_id = sys.argv[1:]
with create_session() as session:
    ti = session.scalar(select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
                                                   TaskInstance.task_id == "approval"))
    assert (ti.state, ti.next_method) == ("scheduled", "execute_complete"), (ti.state, ti.next_method)
    ti.task = SerializedDagModel.get_dag(dag_id, session=session).get_task("approval")
    ti.handle_failure("test: the answered try's stale exit event (apache/airflow#67330)", session=session)
    sys.stdout.write(f"state: {ti.state}\\n")  # one write: print's parts can interleave with a listener's log
    sys.stdout.flush()
"""


def _fail_as_the_stale_exit_event_does(sa: Standalone, run_id: str) -> None:
    done = subprocess.run([sys.executable, "-c", STALE_EXIT_EVENT, RETRAIN, run_id], env=sa.env, cwd=sa.home,
                          capture_output=True, text=True, timeout=300)
    # Its own line among Airflow's (the OpenLineage listener logs the FAIL event it emits to stdout after it).
    assert done.returncode == 0 and "state: up_for_retry" in done.stdout.splitlines(), done.stdout + done.stderr


def _pause(sa: Standalone, paused: bool) -> None:
    with sa.client() as c:
        c.patch(f"/api/v2/dags/{RETRAIN}", json={"is_paused": paused}).raise_for_status()


def _answer(sa: Standalone, run_id: str, option: str, comment: str, user: str = APPROVER) -> dict[str, Any]:
    with sa.client(user=user) as c:
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
        time.sleep(0.5)
    raise AssertionError(f"no log line with {text!r} in {timeout}s:\n{sa.log_tail()}")


def test_no_answer_in_time_rejects_and_the_deadline_alert_fires(standalone: Standalone) -> None:
    run_id = _start(standalone)
    request = _awaiting_approval(standalone, run_id)
    assert request["options"] == ["Approve", "Reject"] and request["defaults"] == ["Reject"]
    assert request["subject"] == f"Publish the new {MODEL} to {ALIAS}?"
    body = request["body"]
    for text in ("`heldout.loss`", "`heldout.perplexity`", "| metric | candidate | live | change |",
                 f"Live on `{ALIAS}`: nothing yet", "**Gate**: passed:", "- passed: evaluate.gate.rules[0]",
                 "No answer within 30 seconds rejects it.",
                 "Who may answer: alice, op1 (publish.policy.production.approvers; not admin, who started this run)."):
        assert text in body, (text, body)
    assert request["assigned_users"] == [{"id": "alice", "name": "alice"}, {"id": "op1", "name": "op1"}]

    run = _finished(standalone, run_id)  # nobody answers: the scheduler's timeout sweep applies Reject
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "skipped"
    assert run["note"] == ("approval: nobody answered within 30 seconds (publish.approval_timeout_s): timed out, "
                           "rejected; not published")
    assert _registry(standalone).models() == []  # nothing published, no alias

    # The run overran train.deadline (20 s) long before it finished: the triggerer logged the alert.
    line = _poll_log(standalone, f"run {run_id} missed its deadline")
    assert "not done 20 seconds (train.deadline) after it was queued at" in line


def test_reject_through_rest_publishes_nothing_and_notes_who_and_why(standalone: Standalone) -> None:
    run_id = _start(standalone)
    _awaiting_approval(standalone, run_id)
    for outsider in ("admin", "user1"):  # the run's own starter, and someone who is no approver: Airflow says no
        with standalone.client(user=outsider) as c:
            refused = c.patch(_hitl_path(run_id), json={"chosen_options": ["Approve"], "params_input": {}})
        assert refused.status_code == 403 and "is not a respondent" in refused.text, refused.text
    answered = _answer(standalone, run_id, "Reject", "perplexity too close to live, wait for more data")
    assert answered["responded_by"]["name"] == APPROVER

    run = _finished(standalone, run_id)
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "skipped"
    assert run["note"] == (f"approval: rejected by {APPROVER}: perplexity too close to live, wait for more data; "
                           "not published")
    registry = _registry(standalone)
    assert registry.models() == [] and registry.live_version(MODEL, ALIAS) is None
    assert "reusing it, no training" in standalone.task_log(RETRAIN, run_id, "train")  # one training in all


def test_approve_through_rest_publishes_and_names_the_approver(standalone: Standalone) -> None:
    run_id = _start_as_the_readme_does(standalone)
    _awaiting_approval(standalone, run_id)
    # The race Airflow 3.3.2 loses when a person answers at once, made certain: the scheduler is held off the
    # run (paused) while the answer is given and the answered try is failed as the stale exit event fails it.
    _pause(standalone, True)
    try:
        _answer(standalone, run_id, "Approve", "numbers look right")
        _fail_as_the_stale_exit_event_does(standalone, run_id)
    finally:  # the module's next tests run on this DAG
        _pause(standalone, False)

    run = _finished(standalone, run_id)  # the retry takes the recorded answer: nobody is asked twice
    assert standalone.task_states(RETRAIN, run_id)["publish"] == "success"
    assert "instead of asking again" in standalone.task_log(RETRAIN, run_id, "approval", try_number=2)
    assert run["note"] == f"published {MODEL} v1 (from scratch) -> alias '{ALIAS}'"  # what, from what, where
    registry = _registry(standalone)
    live = registry.live_version(MODEL, ALIAS)
    assert live is not None and live.version == 1
    assert live.created_by == f"{APPROVER} via airflow {RETRAIN}/{run_id}"
    [move] = registry.history(MODEL, ALIAS)
    assert (move.action, move.from_version, move.to_version) == ("publish", None, 1)
    assert move.actor == live.created_by and move.reason == f"retrain, approved by {APPROVER}: numbers look right"


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
