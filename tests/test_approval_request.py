"""What a person is shown before approving a publish, and what their answer records (tasks/stages/approval.py).

The request is built from a real registry (SQLite) with a live version and a real gate decision on the
candidate's metrics; the answers are the human-in-the-loop responses Airflow hands back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks import REPO_ROOT
from tasks.base.errors import RetrainerError
from tasks.models.resolve import load_config
from tasks.stages.approval import ApprovalAnswer, publish_attribution

ROOT = REPO_ROOT


def test_request_shows_candidate_next_to_live_the_gate_rules_and_the_stakes(tmp_path: Path) -> None:
    from tasks.evaluate import Evaluated, LiveScore
    from tasks.registry import ArtifactRef, Lineage, Registry, upgrade
    from tasks.runs.identity import identity, scratch
    from tasks.stages.gate import judge
    from tasks.stages.lifecycle import stage_approval_request

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml").with_overrides(
        {"publish.registry_url": url, "publish.approval": {"production": "required"},
         "publish.approval_timeout_s": 7200})
    live_numbers = {"heldout.loss": 2.5, "heldout.perplexity": 12.18, "heldout.tokens": 512}
    with Registry(url) as reg:
        v1 = reg.publish_version("tiny-llama", ArtifactRef("a" * 64, "file:///store/a", 10),
                                 Lineage("k" * 64, "m" * 64, "rev", "step-40", data_url="/data/week1"),
                                 {"metrics": live_numbers}, created_by="alice")
        reg.switch_alias("tiny-llama", "production", v1.version, actor="alice", reason="first")
    candidate = {"heldout.loss": 2.25, "heldout.perplexity": 9.4877, "heldout.tokens": 512}
    gate = judge(cfg.evaluate.rules(), candidate, live_numbers, 1, "heldout.loss")
    run = identity(cfg, "d" * 64, scratch(cfg))
    metrics = Evaluated(metrics=candidate, live=LiveScore(1, live_numbers, cached=True), suite_hash="s" * 64,
                        suites=(), loss=2.25, perplexity=9.4877, tokens=512, batches=8, batch_size=8,
                        checkpoint_dir="/runs/d/checkpoints/step-40", checkpoint_tag="step-40", step=40,
                        experiment_key=run.experiment_key)

    request = stage_approval_request(cfg, run, metrics, gate)

    assert request["subject"] == "Publish the new tiny-llama to production?"
    body = request["body"]
    assert f"run `{run.run_id}`" in body and "checkpoint `step-40`" in body
    assert "**v1**" in body and "`alice`" in body and "`/data/week1`" in body  # the live version
    assert "| metric | candidate | live v1 | change |" in body
    assert "| `heldout.loss` | 2.25 | 2.5 | -0.25 (-10.00%) |" in body
    assert "| `heldout.tokens` | 512 | 512 | +0 (+0.00%) |" in body
    assert "**Gate**: passed:" in body
    assert f"- passed: {gate.rules[0]['note']}" in body  # every rule with its result
    assert "No answer within 2 hours rejects it." in body


def test_first_version_request_says_nothing_is_live() -> None:
    from tasks.runs.identity import identity, scratch
    from tasks.stages.approval import request_body

    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml")
    gate = {"publish": True, "reason": "no live model: first version", "rules": []}
    body = request_body("tiny-llama", "production", identity(cfg, "d" * 64, scratch(cfg)),
                        {"metrics": {"heldout.loss": 3.0}, "live": None}, gate, None, 86400)
    assert "nothing yet; this would be the first version" in body
    assert "**Gate**: passed: no live model: first version" in body
    assert "| `heldout.loss` | 3 |  |  |" in body and "No answer within 1 day rejects it." in body


def test_answers_become_the_note_or_the_publish_attribution() -> None:
    admin = {"id": "admin", "name": "admin"}
    rejected = ApprovalAnswer.of(False, admin, {"comment": "loss went up\non   the frozen suite"})
    assert rejected.run_note(60) == "approval: rejected by admin: loss went up on the frozen suite; not published"
    assert ApprovalAnswer.of(False, {"id": "7", "name": "Bo"}, {}).run_note(60) == (
        "approval: rejected by Bo (id 7) (no comment); not published")
    timed_out = ApprovalAnswer.of(False, None, {"comment": ""})  # the timeout applies the default: Reject
    assert timed_out.by is None
    assert timed_out.run_note(5400) == ("approval: nobody answered within 1 hour 30 minutes "
                                        "(publish.approval_timeout_s): timed out, rejected; not published")

    approved = ApprovalAnswer.of(True, admin, {"comment": "ship it"})
    actor, reason = publish_attribution(approved.to_dict(), "airflow retrain_tiny-llama/manual__1")
    assert actor == "admin via airflow retrain_tiny-llama/manual__1"
    assert reason == "retrain, approved by admin: ship it"
    assert publish_attribution(None, "airflow d/r") == ("airflow d/r", "retrain")  # no approval asked, scheduled
    assert publish_attribution(None, "airflow d/r", "bo") == ("bo via airflow d/r", "retrain")  # a person's run
    # The approver is the person behind an approved publish, whoever triggered the run.
    assert publish_attribution(approved.to_dict(), "airflow d/r", "bo")[0] == "admin via airflow d/r"
    # A rejected candidate's publish task cleared and run again still publishes nothing.
    with pytest.raises(RetrainerError, match="rejected by admin: loss went up"):
        publish_attribution(rejected.to_dict(), "airflow d/r")
