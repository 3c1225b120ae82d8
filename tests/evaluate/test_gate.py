"""The gate's decisions: rules over the suites' metrics against the live model or a threshold, and candidates
that are already published versions."""

from __future__ import annotations

from tasks.config.evaluation import EvaluateConfig, GateRule
from tasks.registry import SwitchRecord, VersionRecord
from tasks.stages.gate import judge, known_candidate


def version(n: int) -> VersionRecord:
    return VersionRecord(model="m", version=n, artifact_digest=f"{n:064x}", artifact_url="u", size_bytes=1,
                         config_hash="k", data_manifest_hash="d", code_revision="r", checkpoint_tag="t", metrics={},
                         serving_bytes=None, created_by="ci", created_at="now")


def rules(*specs: dict) -> tuple[GateRule, ...]:
    return tuple(GateRule(**spec) for spec in specs)


def test_default_rule_is_the_first_suites_loss_against_live() -> None:
    default = EvaluateConfig(gate={"tolerance": 0.05}).rules()
    assert default == rules({"metric": "heldout.loss", "tolerance": 0.05})
    first = judge(default, {"heldout.loss": 2.0}, None, None, "heldout.loss")
    assert first.publish and first.reason.startswith("no live model: first version")
    assert judge(default, {"heldout.loss": 2.1}, {"heldout.loss": 2.0}, 3, "heldout.loss").publish  # within 5%
    worse = judge(default, {"heldout.loss": 2.2}, {"heldout.loss": 2.0}, 3, "heldout.loss")
    assert not worse.publish and worse.live_loss == 2.0 and worse.new_loss == 2.2
    assert "evaluate.gate.rules[0] (heldout.loss min vs live, tolerance 0.05 relative)" in worse.reason
    assert "2.2 > 2.1" in worse.reason and "live v3 2" in worse.reason


def test_better_on_new_data_but_forgetting_the_frozen_suite_is_refused_naming_that_rule() -> None:
    gate = rules({"metric": "new.loss"},
                 {"metric": "frozen.loss", "tolerance": 0.02},
                 {"metric": "general.token_prob", "direction": "max", "tolerance": 0.01, "tolerance_kind": "absolute"},
                 {"metric": "general.loss", "against": "absolute", "threshold": 6.0})
    live = {"new.loss": 3.0, "frozen.loss": 2.0, "general.token_prob": 0.30, "general.loss": 4.0}
    candidate = {"new.loss": 2.5, "frozen.loss": 2.1, "general.token_prob": 0.295, "general.loss": 4.1}
    decision = judge(gate, candidate, live, 7, "new.loss")
    assert not decision.publish
    assert "evaluate.gate.rules[1] (frozen.loss min vs live, tolerance 0.02 relative)" in decision.reason
    assert "rules[0]" not in decision.reason and "rules[2]" not in decision.reason  # only the failed rule
    assert [r["passed"] for r in decision.rules] == [True, False, True, True]
    assert decision.rules[1]["limit"] == 2.0 * 1.02 and decision.rules[1]["reference"] == 2.0
    assert decision.rules[2]["limit"] == 0.30 - 0.01  # max: may drop by the absolute tolerance
    # Within tolerance everywhere: published, every rule's result recorded.
    ok = judge(gate, {**candidate, "frozen.loss": 2.03}, live, 7, "new.loss")
    assert ok.publish and len(ok.rules) == 4 and all(r["passed"] for r in ok.rules)
    # An absolute threshold holds for a first version too.
    first = judge(gate, {**candidate, "general.loss": 6.5}, None, None, "new.loss")
    assert not first.publish and "evaluate.gate.rules[3] (general.loss min, threshold 6)" in first.reason


def test_known_candidates() -> None:
    back = SwitchRecord(model="m", alias="prod", seq=3, action="rollback", from_version=2, to_version=1,
                        actor="ops", reason="bad answers", at="t")
    refused = known_candidate("m", "prod", 1.0, version(2), version(1), {2: back})
    assert refused is not None and not refused.publish and refused.candidate_version == 2
    assert "rolled back from prod" in refused.reason and "bad answers" in refused.reason
    assert "retrainer promote" in refused.reason
    live = known_candidate("m", "prod", 1.0, version(2), version(2), {})
    assert live is not None and not live.publish and "already live" in live.reason
    assert known_candidate("m", "prod", 1.0, version(2), version(1), {}) is None  # judged by loss
    assert known_candidate("m", "prod", 1.0, None, version(1), {2: back}) is None  # a new candidate
