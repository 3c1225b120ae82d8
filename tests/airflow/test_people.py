"""A person's roles under Airflow's auth manager, as the alias policy reads them (retrainer_airflow/people.py)."""

from __future__ import annotations

import pytest

from tasks.base.policy import AliasPolicy, NotPermittedError, check_approver, check_mover


@pytest.fixture
def conf_set(monkeypatch: pytest.MonkeyPatch):
    """Set Airflow configuration for one test (the session's users: tests/services.py AIRFLOW_TEST_USERS)."""
    from airflow.configuration import conf

    def put(section: str, key: str, value: str) -> None:
        monkeypatch.setenv(f"AIRFLOW__{section.upper()}__{key.upper()}", value)
        assert conf.get(section, key) == value

    return put


def test_the_simple_auth_manager_ranks_roles_and_lists_who_may_answer() -> None:
    from retrainer_airflow.people import person, respondents

    assert person("alice").roles == frozenset({"op", "user", "viewer"})  # op outranks user and viewer
    assert person("admin").roles == frozenset({"admin", "op", "user", "viewer"})
    assert person("viewer1").roles == frozenset({"viewer"})
    assert person("mallory").roles == frozenset()  # not a user of this Airflow: no role at all
    ops = ("role:op",)
    assert respondents(ops, excluding=None) == [{"id": n, "name": n} for n in ("admin", "alice", "op1")]
    assert [u["name"] for u in respondents(ops, excluding="admin")] == ["alice", "op1"]  # the run's own starter
    assert respondents(("alice",), excluding="alice") == []  # nobody left: the approval task refuses at once
    check_mover(AliasPolicy(), "production", person("op1"), "roll back")
    with pytest.raises(NotPermittedError, match=r"user1 \(role user, viewer\) may not roll back"):
        check_mover(AliasPolicy(), "production", person("user1"), "roll back")


def test_everyone_is_admin_in_all_admins_mode_and_roles_are_unknown_under_another_auth_manager(conf_set) -> None:
    from retrainer_airflow.people import person, respondents

    conf_set("core", "simple_auth_manager_all_admins", "True")
    assert "admin" in person("Anonymous").roles and respondents(("role:op",), None) is None  # anyone may answer
    with pytest.raises(NotPermittedError, match="started this run and may not approve it"):  # the task still checks
        check_approver(AliasPolicy(approval="required"), "production", person("Anonymous"), "Anonymous")
    conf_set("core", "simple_auth_manager_all_admins", "False")
    conf_set("core", "auth_manager", "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager")
    fab_user = person("alice")
    assert fab_user.roles is None and respondents(("role:op",), None) is None
    with pytest.raises(NotPermittedError, match="roles unknown to retrainer under this auth manager"):
        check_approver(AliasPolicy(approval="required"), "production", fab_user, "bob")
    check_approver(AliasPolicy(approval="required", approvers=("alice",)), "production", fab_user, "bob")


def test_the_approval_task_itself_refuses_an_answer_from_someone_the_policy_does_not_admit(tmp_path) -> None:
    """Whatever let the answer through (another auth manager, everyone an admin), the task checks who answered:
    an Approve from someone not in production's approvers is noted on the run and publishes nothing; alice's
    counts."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from retrainer_airflow.operators import PublishApproval

    from tasks.models.resolve import ConfigSnapshot
    from tasks.plan import plan
    from tasks.runs.identity import identity, scratch
    from tasks.stages.lifecycle import Planned
    from tests.airflow.conftest import ROOT

    job = ConfigSnapshot.take(ROOT / "configs" / "tiny-llama.yaml", {
        "publish.policy": {"production": {"approval": "required", "approvers": ["alice"]}}})
    cfg = job.config()
    plan_out = Planned(job, identity(cfg, "d" * 64, scratch(cfg)), plan(cfg, device="cpu"), None).to_xcom()
    approval = PublishApproval(task_id="approval", subject="s", plan_out=plan_out, metrics={}, decision={})
    notes: list[str] = []
    context = {"ti": SimpleNamespace(xcom_push=lambda key, value: notes.append(value)),
               "dag_run": SimpleNamespace(triggering_user_name="bob")}

    def answer(user: str) -> dict:
        return approval.execute_complete(context, {
            "chosen_options": ["Approve"], "params_input": {"comment": "lgtm"}, "responded_at": datetime.now(UTC),
            "responded_by_user": {"id": user, "name": user}})

    assert answer("user1") == {"approved": False, "by": "user1", "comment": "lgtm"}
    assert notes == ["approval: an answer from user1 does not count: user1 (role user, viewer) may not approve a "
                     "move onto 'production': publish.policy.production.approvers is [alice]; nothing moved"]
    assert answer("alice") == {"approved": True, "by": "alice", "comment": "lgtm"} and len(notes) == 1
