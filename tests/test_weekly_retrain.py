"""The weekly retrain as a platform team runs it, through the real `retrainer` CLI, in order.

Same config every week (`train.init_from: live`), new data at the same URL, an operator's rollback
in between, the schedule firing again after it: did each run train, from what, and what is live.
(The same sequence through Airflow's `dag.test()` on PostgreSQL is in tests/dags/test_lifecycle_e2e.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks import REPO_ROOT
from tests.services import free_port

ROOT = REPO_ROOT
pytestmark = pytest.mark.multiproc


def week_config(tmp: Path) -> Path:
    """The demo config shrunk to one CPU rank; its model, schedule and init_from are the demo's."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32, dropout=0.0)
    cfg["parallel"].update(dp=1)
    cfg["train"].update(steps=8, checkpoint_every=4, micro_batch_size=8, warmup_steps=2, lr=1e-2,
                        output_dir=str(tmp / "runs"))
    cfg["data"].update(source_url=str(tmp / "store" / "corpus"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=8)
    cfg["publish"].update(registry_url=f"sqlite:///{tmp / 'registry.db'}", store_url=str(tmp / "store" / "models"))
    assert cfg["train"]["init_from"] == "live"
    path = tmp / "tiny-llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def retrainer(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RETRAINER_HOME": str(tmp / "home")}
    env.pop("RETRAINER_DB_URL", None)
    return subprocess.run([sys.executable, "-m", "tasks.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)


def run(config: Path, tmp: Path) -> dict[str, Any]:
    done = retrainer("run", str(config), "--json", tmp=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def new_week(config: Path, tmp: Path, seed: int) -> None:
    done = retrainer("make-data", str(config), "--seed", str(seed), "--tokens-per-shard", "16384", "--overwrite",
                     tmp=tmp)  # this week's data replaces last week's at the same URL
    assert done.returncode == 0, done.stderr[-2000:]


def show(tmp: Path) -> dict[str, Any]:
    done = retrainer("registry", "show", "--model", "tiny-llama", "--db", f"sqlite:///{tmp / 'registry.db'}", "--json",
                     tmp=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_weekly_retrain_trains_on_new_data_from_production_and_respects_a_rollback(tmp_path: Path) -> None:
    config = week_config(tmp_path)
    steps = 8
    # Once per deployment: the registry schema (no other command changes it).
    assert retrainer("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'registry.db'}", tmp=tmp_path).returncode == 0

    # Week 1: nothing is live yet, so the run starts from scratch and says so.
    new_week(config, tmp_path, seed=101)
    week1 = run(config, tmp_path)
    assert week1["run"]["init"]["digest"] is None and "no live version" in week1["run"]["init"]["note"]
    assert week1["train"]["outcome"] == "trained" and week1["train"]["trained_steps"] == steps
    assert week1["publish"]["version"] == 1 and week1["publish"]["parent_version"] is None
    scratch_first_loss = week1["train"]["first_loss"]

    # Week 2: new data at the same URL, the same config: a real run of every step, from v1's weights.
    new_week(config, tmp_path, seed=202)
    week2 = run(config, tmp_path)
    assert week2["run"]["data_manifest_hash"] != week1["run"]["data_manifest_hash"]
    assert week2["experiment_key"] != week1["experiment_key"]
    assert week2["train"]["outcome"] == "trained" and week2["train"]["resumed_from_step"] is None
    assert week2["train"]["trained_steps"] == steps and len(week2["train"]["losses"]) == steps
    assert week2["train"]["first_loss"] < scratch_first_loss - 1.0  # it continued from v1, not from random
    assert week2["publish"]["version"] == 2 and week2["publish"]["switched"]
    versions = {v["version"]: v for v in show(tmp_path)["versions"]}
    assert versions[2]["parent_version"] == 1
    assert versions[2]["init_digest"] == versions[1]["artifact_digest"]
    assert versions[2]["artifact_digest"] != versions[1]["artifact_digest"]
    assert versions[2]["data_manifest_hash"] == week2["run"]["data_manifest_hash"]

    # The operator rolls production back to v1.
    back = retrainer("rollback", "--model", "tiny-llama", "--db", f"sqlite:///{tmp_path / 'registry.db'}",
                     "--reason", "bad answers in prod", tmp=tmp_path)
    assert back.returncode == 0 and "version 2 -> version 1" in back.stdout, back.stderr

    # The schedule fires again on week 2's data: the same run (v1 + week 2) is v2 again; not put back, and
    # refused before anything runs (its result is known: no warm, no training, no evaluation ranks).
    again = run(config, tmp_path)
    assert again["experiment_key"] == week2["experiment_key"]
    assert again["skipped"].startswith("gate: candidate is tiny-llama v2"), again
    assert "rolled back from production" in again["skipped"] and "bad answers in prod" in again["skipped"]
    assert not {"warm", "train", "evaluate", "gate", "publish"} & again.keys(), again.keys()
    info = show(tmp_path)
    assert info["aliases"]["production"]["version"] == 1
    assert "production" in {v["version"]: v for v in info["versions"]}[2]["rolled_back_from"]

    # Week 3: new data; the run starts from what is live now (v1) and becomes v3.
    new_week(config, tmp_path, seed=303)
    week3 = run(config, tmp_path)
    assert week3["train"]["outcome"] == "trained" and week3["run"]["init"]["version"] == 1
    assert week3["publish"]["version"] == 3 and week3["publish"]["parent_version"] == 1
    info = show(tmp_path)
    assert info["aliases"]["production"]["version"] == 3
    assert [v["parent_version"] for v in info["versions"]] == [None, 1, 1]
    assert [v["started_from"] for v in info["versions"]] == ["scratch", "version 1", "version 1"]
    assert all("created" not in v for v in info["versions"])

    # What a person reads: where the run started, and that it trained.
    done = retrainer("registry", "history", "--model", "tiny-llama", "--db", f"sqlite:///{tmp_path / 'registry.db'}",
                     tmp=tmp_path)
    assert "3 (from v1)" in done.stdout
    # The schedule fires again before new data lands: production was trained on this data, nothing to do
    # (it must not fine-tune production on the same data again every week).
    text = retrainer("run", str(config), tmp=tmp_path)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "started from tiny-llama v3 (live on production)" in text.stdout
    assert "no new data" in text.stdout and "nothing to train" in text.stdout
    assert show(tmp_path)["aliases"]["production"]["version"] == 3

    # By hand, an operator wants v1 back on production: v1 is not rolled back, so that is a promotion, held to
    # production's gate. Scored afresh (the store's evaluation cache emptied): one rank job scores v1 and v3 on
    # this week's held-out data; v3's numbers are exactly those its publish recorded. A gate v1 cannot pass
    # refuses it, naming the rule; one it passes moves production, recorded as a promotion with the gate.
    import shutil

    shutil.rmtree(tmp_path / "store" / "models" / "eval-cache")
    doc = yaml.safe_load(config.read_text())
    for name, threshold in (("strict", 0.01), ("lenient", 100.0)):
        doc["evaluate"]["gate"] = {"rules": [{"metric": "heldout.loss", "against": "absolute", "threshold": threshold}]}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    # Where production needs a person's approval, a command line (nobody to approve) moves nothing, trains nothing.
    doc["publish"]["policy"] = {"production": {"approval": "required"}}
    (tmp_path / "approved.yaml").write_text(yaml.safe_dump(doc))
    del doc["publish"]["policy"]
    runs_before = sorted((tmp_path / "runs").iterdir())
    approved = str(tmp_path / "approved.yaml")
    for verb in (("promote", approved, "--version", "1"), ("run", approved)):
        refused = retrainer(*verb, tmp=tmp_path)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines()[-1] == (
            "retrainer: error: publish.policy.production.approval is required: a person in its approvers approves "
            "every move onto 'production', under Airflow (the approval step of retrain_tiny-llama or promote_model); "
            "none was given here: nothing moved")
    assert sorted((tmp_path / "runs").iterdir()) == runs_before and not (tmp_path / "store" / "models" /
                                                                           "eval-cache").exists()
    strict = retrainer("promote", str(tmp_path / "strict.yaml"), "--version", "1", tmp=tmp_path)
    assert strict.returncode == 2, strict.stderr[-2000:]
    assert ("retrainer: error: promoting v1 onto 'production': refused by evaluate.gate.rules[0] (heldout.loss min, "
            "threshold 0.01)") in strict.stderr and "Traceback" not in strict.stderr, strict.stderr[-2000:]
    assert show(tmp_path)["aliases"]["production"]["version"] == 3
    cached = {int(p.parent.name[1:]): json.loads(p.read_text())["metrics"]
              for p in (tmp_path / "store" / "models" / "eval-cache" / "tiny-llama").glob("v*/*.json")}
    assert set(cached) == {1, 3}
    recorded = {v["version"]: v for v in show(tmp_path)["versions"]}[3]["metrics"]["metrics"]
    assert cached[3]["heldout.loss"] == pytest.approx(recorded["heldout.loss"], rel=1e-6)
    lenient = retrainer("promote", str(tmp_path / "lenient.yaml"), "--version", "1", "--reason", "v1 answers best",
                        "--json", tmp=tmp_path)
    assert lenient.returncode == 0, lenient.stderr[-2000:]
    move = json.loads(lenient.stdout)
    assert (move["action"], move["from_version"], move["to_version"]) == ("promote", 3, 1)
    assert move["reason"].startswith("v1 answers best; gate: evaluate.gate.rules[0] (heldout.loss min, threshold 100)")


def test_a_run_whose_node_cannot_hold_its_ranks_stops_at_the_plan_naming_the_field(tmp_path: Path) -> None:
    """The week's run on a node too small for its ranks' host memory (`cluster.host_memory_gib`: here less than
    two ranks' runtime) stops at the plan, before any rank or run directory exists, and says why: the term, by how
    much, and the field to change (the plan task's error in Airflow is this one)."""
    config = week_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["cluster"]["host_memory_gib"] = 0.25
    config.write_text(yaml.safe_dump(cfg))
    assert retrainer("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'registry.db'}", tmp=tmp_path).returncode == 0
    assert retrainer("make-data", str(config), "--tokens-per-shard", "16384", tmp=tmp_path).returncode == 0
    done = retrainer("run", str(config), tmp=tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("retrainer: error:")]
    assert error and "plan: does_not_fit: " in error[0] and "over cluster.host_memory_gib (256.00 MiB) on a node: " \
        "its ranks' host memory together" in error[0], done.stderr[-2000:]
    assert "launching" not in done.stderr and not Path(cfg["train"]["output_dir"]).exists()
    assert "activation_checkpointing" not in done.stderr  # recomputation frees device memory, not the host's
