"""Deploy on model events under a real scheduler (the package's `airflow standalone`; this model has `deploy.enabled`).

A manual retrain publishes v1; its alias-moved event starts `deploy_deploy-llama`, whose smoke test loads the export
with transformers and reproduces the evaluated loss, and whose hook (`tests.hooks.deploy:record`) receives v1's
verified directory. Then a broken export is published as v2 from outside Airflow and its event announced through
the REST API: the smoke test fails, the `rollback` task moves the alias back to v1 with the failure as the audited
reason, and the rollback's own event deploys v1 again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.airflow.conftest import Standalone, Tenant

MODEL, ALIAS = "deploy-llama", "production"
RETRAIN, DEPLOY = f"retrain_{MODEL}", f"deploy_{MODEL}"

pytestmark = pytest.mark.multiproc


def _deploys(cfg: dict[str, Any]) -> None:
    cfg["deploy"] = {"enabled": True, "entry_point": "tests.hooks.deploy:record"}


TENANT = Tenant(models={MODEL: _deploys}, dag_ids=(RETRAIN, DEPLOY))


def _cfg(sa: Standalone):
    from tasks.models.resolve import load_config

    return load_config(sa.config_path(MODEL))


def _hook_calls(sa: Standalone) -> list[dict[str, Any]]:
    path = sa.model_home(MODEL) / "cache" / "deploy" / MODEL / "hook.jsonl"  # deploy.models_dir's default
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _publish_broken(sa: Standalone, tmp: Path) -> int:
    """Publish v1's export with its weight shard cut in half as the next version, as a faulty exporter would: a
    consistent tree (every file as hashed), its bytes unloadable."""
    from tasks.registry import ArtifactStore, Lineage, Registry

    cfg = _cfg(sa)
    store = ArtifactStore(cfg.publish.store_url)
    with Registry(cfg.publish.registry_url) as reg:
        live = reg.live_version(MODEL, ALIAS)
        tree = store.get_tree(live.artifact_digest, tmp / "broken")
        for shard in tree.glob("*.safetensors"):
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        lineage = Lineage(config_hash=live.config_hash, data_manifest_hash=live.data_manifest_hash,
                          code_revision="test", checkpoint_tag="broken", serving_bytes=None,
                          parent_version=live.version, data_url=live.data_url)
        rec = reg.publish_version(MODEL, store.put_tree(tree), lineage, live.metrics, created_by="test")
        reg.switch_alias(MODEL, ALIAS, rec.version, expect=live.version, actor="test", reason="broken export",
                         action="publish")
    return rec.version


def test_a_publish_deploys_and_a_broken_export_is_rolled_back(standalone: Standalone, tmp_path: Path) -> None:
    from tasks.registry import Registry, alias_asset_uri

    sa = standalone
    with sa.client() as c:
        for dag_id in (RETRAIN, DEPLOY):
            c.patch(f"/api/v2/dags/{dag_id}", json={"is_paused": False}).raise_for_status()
    registry = Registry(_cfg(sa).publish.registry_url)

    # A retrain publishes v1: its event starts the deploy, which passes the smoke test and hands v1 to the hook.
    known = sa.run_ids(DEPLOY)
    resp = sa.trigger(RETRAIN, {})
    assert resp.status_code == 200, resp.text
    trained = resp.json()["dag_run_id"]
    assert sa.wait_run(RETRAIN, trained)["state"] == "success", sa.task_states(RETRAIN, trained)
    assert registry.live_version(MODEL, ALIAS).version == 1
    first = sa.next_run(DEPLOY, known)
    assert sa.wait_run(DEPLOY, first)["state"] == "success", sa.task_states(DEPLOY, first)
    assert sa.task_states(DEPLOY, first) == {"pull": "success", "smoke_test": "success", "hook": "success",
                                             "deployed": "success", "rollback": "skipped"}
    smoke_log = sa.task_log(DEPLOY, first, "smoke_test")
    assert "smoke test of v1 passed" in smoke_log and "evaluated" in smoke_log, smoke_log[-3000:]
    (call,) = _hook_calls(sa)
    assert (call["version"], call["alias"], call["moved_by"], call["event_version"]) == (1, ALIAS, "publish", 1)
    assert call["has_config"] and call["digest"] == registry.live_version(MODEL, ALIAS).artifact_digest

    # A broken export becomes v2 outside Airflow, announced through the REST API like any producer would.
    known = sa.run_ids(DEPLOY)
    assert _publish_broken(sa, tmp_path) == 2
    with sa.client() as c:
        uri = alias_asset_uri(MODEL, ALIAS)
        (asset,) = [a for a in c.get("/api/v2/assets", params={"uri_pattern": uri}).raise_for_status().json()["assets"]
                    if a["uri"] == uri]
        c.post("/api/v2/assets/events", json={"asset_id": asset["id"], "extra": {"version": 2}}).raise_for_status()
    broken = sa.next_run(DEPLOY, known)
    assert sa.wait_run(DEPLOY, broken)["state"] == "failed"
    assert sa.task_states(DEPLOY, broken) == {"pull": "success", "smoke_test": "failed", "hook": "upstream_failed",
                                              "deployed": "upstream_failed", "rollback": "success"}
    assert registry.live_version(MODEL, ALIAS).version == 1
    last = registry.history(MODEL, ALIAS)[-1]
    assert (last.action, last.from_version, last.to_version) == ("rollback", 2, 1)
    assert last.reason.startswith("deploy: smoke test failed: v2: loading the export with transformers: "), last.reason
    assert last.actor == f"airflow {DEPLOY}/{broken}"
    assert len(_hook_calls(sa)) == 1  # v2 never reached the hook

    # The rollback's event deploys v1 again: serving gets the old version back.
    again = sa.next_run(DEPLOY, known | {broken})
    assert sa.wait_run(DEPLOY, again)["state"] == "success", sa.task_states(DEPLOY, again)
    assert [(c["version"], c["moved_by"]) for c in _hook_calls(sa)] == [(1, "publish"), (1, "rollback")]
    assert "already pulled" in sa.task_log(DEPLOY, again, "pull")
