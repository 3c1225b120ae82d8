"""The gate's decisions: loss against the live model, and candidates that are already published versions."""

from __future__ import annotations

from tasks.gate import decide, known_candidate
from tasks.registry import SwitchRecord, VersionRecord


def version(n: int) -> VersionRecord:
    return VersionRecord(model="m", version=n, artifact_digest=f"{n:064x}", artifact_url="u", size_bytes=1,
                         config_hash="k", data_manifest_hash="d", code_revision="r", checkpoint_tag="t", metrics={},
                         serving_bytes=None, created_by="ci", created_at="now")


def test_loss_against_live() -> None:
    assert decide(2.0, None, 0.0).publish
    assert decide(2.0, 2.0, 0.0).publish
    assert decide(2.05, 2.0, 0.05).publish
    worse = decide(2.2, 2.0, 0.05, live_version=3)
    assert not worse.publish and "worse than live v3" in worse.reason


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
