"""Who may move or approve a move onto an alias (tasks/base/policy.py): names and roles against the alias's lists."""

from __future__ import annotations

import pytest

from tasks.base.policy import AliasPolicy, NotPermittedError, Person, admits, check_approver, check_mover

OPS = frozenset({"op", "user", "viewer"})  # what the simple auth manager's ranking gives an `op`


def test_entries_admit_by_user_name_or_role_and_unknown_roles_admit_by_name_only() -> None:
    entries = ("alice", "role:Op")
    assert admits(entries, Person("alice", frozenset()))
    assert admits(entries, Person("bob", OPS))  # role names compare case-insensitively
    assert not admits(entries, Person("carol", frozenset({"user", "viewer"})))
    assert not admits(entries, Person("bob", None))  # roles unreadable: a role entry cannot admit
    assert admits(entries, Person("alice", None))


def test_a_mover_check_names_the_person_their_roles_and_the_policy_field() -> None:
    policy = AliasPolicy(movers=("role:op",))
    check_mover(policy, "production", Person("ops1", OPS), "roll back")
    with pytest.raises(NotPermittedError) as refused:
        check_mover(policy, "production", Person("user1", frozenset({"user", "viewer"})), "roll back")
    assert str(refused.value) == ("user1 (role user, viewer) may not roll back 'production': "
                                  "publish.policy.production.movers is [role:op]")
    assert refused.value.exit_code == 2
    with pytest.raises(NotPermittedError, match="roles unknown to retrainer under this auth manager"):
        check_mover(policy, "production", Person("fab-user", None), "roll back")


def test_approvers_exclude_the_person_who_started_the_run_unless_the_alias_allows_it() -> None:
    policy = AliasPolicy(approval="required", approvers=("alice", "role:op"))
    check_approver(policy, "production", Person("alice", frozenset()), triggered_by="bob")
    check_approver(policy, "production", Person("alice", frozenset()), triggered_by=None)  # a scheduled run
    with pytest.raises(NotPermittedError, match="alice started this run and may not approve it: "
                                                r"publish\.policy\.production\.self_approval is forbidden"):
        check_approver(policy, "production", Person("alice", frozenset()), triggered_by="alice")
    check_approver(policy.model_copy(update={"self_approval": "allowed"}), "production",
                   Person("alice", frozenset()), triggered_by="alice")
    with pytest.raises(NotPermittedError, match=r"user1 \(role user\) may not approve a move onto 'production': "
                                                r"publish\.policy\.production\.approvers is \[alice, role:op\]"):
        check_approver(policy, "production", Person("user1", frozenset({"user"})), triggered_by="bob")


def test_a_forced_promotion_is_for_movers_only_and_says_why(tmp_path) -> None:
    """promote_model's `force` (past the gate) is checked against the person who asked, before anything is read
    or scored; without force anyone who may start promote_model may ask, since the gate and approval decide."""
    from pathlib import Path

    from tasks.base.errors import InvalidInputError
    from tasks.models.resolve import ConfigSnapshot
    from tasks.stages.promote import stage_promote_check

    demo = Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.yaml"
    job = ConfigSnapshot.take(demo, {"publish.registry_url": f"sqlite:///{tmp_path / 'registry.db'}"})
    with pytest.raises(NotPermittedError, match=r"user1 \(role user\) may not force a promotion past the gate of "
                                                r"'production': publish\.policy\.production\.movers is \[role:op\]"):
        stage_promote_check(job, 1, force=True, reason="trust me", requester=Person("user1", frozenset({"user"})))
    with pytest.raises(InvalidInputError, match=r"a forced promotion onto 'production' .* needs a reason"):
        stage_promote_check(job, 1, force=True, reason=" ", requester=Person("op1", OPS))
    with pytest.raises(InvalidInputError, match="version: the version to promote"):
        stage_promote_check(job, None)
    assert not (tmp_path / "registry.db").exists()  # refused before the registry was even opened
