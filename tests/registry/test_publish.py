"""Publish stage end to end: upload, immutable version, CAS switch; crash safety under SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig
from tasks.models.weights import weights_digest
from tasks.registry import ArtifactStore, Registry, upgrade
from tasks.stages.publish import publish
from tests.registry.conftest import ROOT, experiment_key_of, make_checkpoint

METRICS = {"loss": 2.5, "tokens": 4096}


def test_publish_uploads_records_lineage_and_moves_alias(
    registry_url: str, job_config: Callable[..., JobConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RETRAINER_CODE_REVISION", "deadbeef")
    upgrade(registry_url)
    cfg = job_config(registry_url)
    c1 = make_checkpoint(tmp_path / "ckpt", cfg, "step-10", seed=1, data_manifest_hash="m1")
    c2 = make_checkpoint(tmp_path / "ckpt", cfg, "step-20", seed=2, data_manifest_hash="m2")
    r1 = publish(cfg, c1, METRICS, serving_bytes=1 << 20, actor="ci")
    assert (r1.version, r1.previous_version, r1.created, r1.switched) == (1, None, True, True)
    r2 = publish(cfg, c2, {"loss": 2.0}, actor="ci")
    assert (r2.version, r2.previous_version) == (2, 1)
    assert r2.asset_uri == "model://tiny-llama/production"
    again = publish(cfg, c2, {"loss": 2.0}, actor="ci")
    assert (again.version, again.created, again.switched) == (2, False, False)

    with Registry(registry_url) as reg:
        v1 = reg.get_version("tiny-llama", 1)
        assert (v1.code_revision, v1.config_hash, v1.data_manifest_hash, v1.checkpoint_tag) == (
            "deadbeef", experiment_key_of(c1), "m1", "step-10")
        assert (v1.parent_version, v1.init_digest, v1.data_url) == (None, None, cfg.data.source_url)
        assert v1.metrics == METRICS and v1.serving_bytes == 1 << 20 and v1.created_by == "ci"
        # What made it, beside the hashes: the resolved config (a checkpoint from scratch says so).
        assert v1.started_from == "scratch" and v1.config == cfg.model_dump(mode="json")
        assert (v1.config["train"]["steps"], v1.config["parallel"]["dp"]) == (cfg.train.steps, cfg.parallel.dp)
        assert reg.live_version("tiny-llama", "production").version == 2
        assert [(h.action, h.from_version, h.to_version) for h in reg.history("tiny-llama")] == [
            ("publish", None, 1), ("publish", 1, 2)]
    # The artifact in the store is the checkpoint's export: a Hugging Face directory holding its weights.
    out = ArtifactStore(cfg.publish.store_url).get_tree(r2.digest, tmp_path / "dl")
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert weights_digest(out, cfg.model) == weights_digest(c2, cfg.model)


def test_publish_to_s3_store(
    sqlite_url: str, job_config: Callable[..., JobConfig], tmp_path: Path, s3, s3_bucket: str
) -> None:
    upgrade(sqlite_url)
    cfg = job_config(sqlite_url, f"s3://{s3_bucket}/models", **{"publish.storage_options": s3.storage_options})
    res = publish(cfg, make_checkpoint(tmp_path, cfg, "step-10"), METRICS, actor="ci")
    assert res.artifact_url == f"s3://{s3_bucket}/models/trees/{res.digest[:2]}/{res.digest}"
    assert s3.filesystem().exists(f"{res.artifact_url}/model.safetensors.index.json")
    # The store's key and secret reached the store, not the version's record of its config.
    with Registry(sqlite_url) as reg:
        record = reg.get_version("tiny-llama", res.version)
    assert record.config["publish"]["storage_options"] == {
        "key": "<redacted>", "secret": "<redacted>", "client_kwargs": {"endpoint_url": s3.endpoint_url}}
    assert s3.key not in json.dumps(record.to_dict()) and s3.secret not in json.dumps(record.to_dict())


def test_publish_refuses_bad_checkpoints(
    sqlite_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    cfg = job_config(sqlite_url)
    incomplete = make_checkpoint(tmp_path, cfg, "step-10")
    (incomplete / "COMPLETE").unlink()
    with pytest.raises(InvalidInputError, match=rf"{incomplete}: not a complete checkpoint \(no COMPLETE marker\)"):
        publish(cfg, incomplete, METRICS)
    foreign = make_checkpoint(tmp_path, cfg, "step-20", fingerprint="0" * 64)
    with pytest.raises(InvalidInputError, match="checkpoint from another model"):
        publish(cfg, foreign, METRICS)
    with pytest.raises(InvalidInputError, match="does not exist"):
        publish(cfg, tmp_path / "nope", METRICS)
    ok = make_checkpoint(tmp_path, cfg, "step-30")
    with pytest.raises(InvalidInputError, match="non-finite"):
        publish(cfg, ok, {"loss": float("inf")})
    # Nothing half-written: no version, no pointer, no artifact uploaded.
    upgrade(sqlite_url)
    with Registry(sqlite_url) as reg:
        assert reg.models() == []
    assert not Path(cfg.publish.store_url).exists()


def _publish_process(cfg: JobConfig, ckpt: Path, tmp_path: Path, **env: str) -> subprocess.Popen[bytes]:
    """`retrainer publish` in its own process (the real entry point, with the test hooks installed)."""
    config_file = tmp_path / f"job-{ckpt.name}.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    metrics_file = tmp_path / "metrics.json"
    metrics_file.write_text(json.dumps(METRICS))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.hooks.cli", "publish", str(config_file), "--checkpoint", str(ckpt),
         "--metrics", str(metrics_file), "--json"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _wait_for_versions(reg: Registry, n: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while len(reg.list_versions("tiny-llama")) < n:
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "publish never reached the fault point"
        time.sleep(0.1)


def test_publish_cas_fails_cleanly_when_pointer_moved(
    registry_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    """Someone promotes another version while publish runs: publish fails with a conflict, no lost update."""
    upgrade(registry_url)
    cfg = job_config(registry_url)
    publish(cfg, make_checkpoint(tmp_path, cfg, "a", seed=1), METRICS)
    publish(cfg, make_checkpoint(tmp_path, cfg, "b", seed=2), METRICS)
    release = tmp_path / "release"
    proc = _publish_process(cfg, make_checkpoint(tmp_path, cfg, "c", seed=3), tmp_path,
                            HOOK_PUBLISH_BLOCK="after_version_insert", HOOK_PUBLISH_RELEASE=str(release))
    try:
        with Registry(registry_url) as reg:
            _wait_for_versions(reg, 3, proc)
            reg.switch_alias("tiny-llama", "production", 1, actor="ops", reason="manual hotfix")
            release.touch()
            _out, err = proc.communicate(timeout=120)
            assert proc.returncode == 1
            assert "expected version 2 but it points to version 1" in err.decode()
            assert reg.live_version("tiny-llama", "production").version == 1  # the operator's switch stands
            assert [(h.actor, h.to_version) for h in reg.history("tiny-llama")][-1] == ("ops", 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_between_version_insert_and_switch(
    pg_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    upgrade(pg_url)
    cfg = job_config(pg_url)
    first = publish(cfg, make_checkpoint(tmp_path, cfg, "step-10", seed=1), METRICS)
    ckpt2 = make_checkpoint(tmp_path, cfg, "step-20", seed=2)
    proc = _publish_process(cfg, ckpt2, tmp_path, HOOK_PUBLISH_BLOCK="after_version_insert")
    try:
        with Registry(pg_url) as reg:
            _wait_for_versions(reg, 2, proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
            live = reg.live_version("tiny-llama", "production")
            assert live is not None and live.version == first.version  # pointer on the complete old version
            assert ArtifactStore(cfg.publish.store_url).verify_tree(live.artifact_digest)
            assert [v.version for v in reg.list_versions("tiny-llama")] == [1, 2]  # v2 exists, unpointed
            assert len(reg.history("tiny-llama")) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rerun = publish(cfg, ckpt2, METRICS)
    assert (rerun.version, rerun.created, rerun.previous_version, rerun.switched) == (2, False, 1, True)
    with Registry(pg_url) as reg:
        assert reg.live_version("tiny-llama", "production").version == 2
        assert [(h.from_version, h.to_version) for h in reg.history("tiny-llama")] == [(None, 1), (1, 2)]


def test_a_rollback_while_a_candidate_awaits_approval_is_not_undone(
    registry_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    """Week 3's candidate is judged against v2 and waits for a person; meanwhile an operator rolls production
    back to v1. Approving the candidate must not move production off the operator's choice: it was never
    compared with v1. A retry of a publish that did switch is no such case."""
    from tasks.base.errors import LiveMovedError

    upgrade(registry_url)
    cfg = job_config(registry_url)
    publish(cfg, make_checkpoint(tmp_path, cfg, "a", seed=1), METRICS)
    publish(cfg, make_checkpoint(tmp_path, cfg, "b", seed=2), METRICS)
    candidate = make_checkpoint(tmp_path, cfg, "c", seed=3)
    with Registry(registry_url) as reg:
        reg.rollback("tiny-llama", "production", actor="ops", reason="v2 answers in the wrong language")
        with pytest.raises(LiveMovedError, match=r"production is v1 now; the gate compared this candidate with v2"):
            publish(cfg, candidate, METRICS, judged_live=2)
        assert reg.live_version("tiny-llama", "production").version == 1
        assert [v.version for v in reg.list_versions("tiny-llama")] == [1, 2]  # nothing written
        result = publish(cfg, candidate, METRICS, judged_live=1)  # judged again, against v1
        assert result.switched and result.version == 3
        again = publish(cfg, candidate, METRICS, judged_live=1)  # a retry after the switch: already live
        assert again.version == 3 and not again.switched
