"""The weekly LoRA retrain as a team runs it, through the real `retrainer` CLI, in order.

A base model B is a registry version (`tiny-base`, trained here once); the LoRA job names it
(`model.base: {model: tiny-base, alias: production}`) with `train.init_from: live`. Week 1 trains a fresh
adapter on B (v1); week 2 continues v1's adapter on new data (v2), the gate scoring live v1 as B + its
adapter; the operator rolls back to v1; then the
base itself is retrained (B v2) and the next LoRA run starts a fresh adapter on it, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.services import free_port
from tests.test_weekly_retrain import new_week, retrainer, week_config

pytestmark = pytest.mark.multiproc
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def configs(tmp: Path) -> tuple[Path, Path]:
    """(base job, LoRA job): the weekly config shrunk to one CPU rank, sharing data, registry and store."""
    base = yaml.safe_load(week_config(tmp).read_text())
    base.update(name="tiny-base")
    base["train"].update(init_from="scratch", output_dir=str(tmp / "runs" / "base"))
    base["publish"].pop("model_name", None)
    lora = yaml.safe_load(yaml.safe_dump(base))
    lora.update(name="tiny-lora")
    lora["model"]["base"] = {"model": "tiny-base", "alias": "production"}
    lora["train"].update(init_from="live", lora=LORA, output_dir=str(tmp / "runs" / "lora"))
    assert "lora_export" not in lora["publish"]  # the default: the adapter alone, scored on its base by the gate
    lora["cluster"]["master_port"] = free_port()
    paths = tmp / "base.yaml", tmp / "lora.yaml"
    for path, cfg in zip(paths, (base, lora), strict=True):
        path.write_text(yaml.safe_dump(cfg))
    return paths


def run(config: Path, tmp: Path) -> dict[str, Any]:
    done = retrainer("run", str(config), "--json", tmp=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def versions(model: str, tmp: Path) -> dict[int, dict[str, Any]]:
    done = retrainer("registry", "show", "--model", model, "--db", f"sqlite:///{tmp / 'registry.db'}", "--json",
                     tmp=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return {v["version"]: v for v in json.loads(done.stdout)["versions"]}


def test_weekly_lora_continues_on_its_base_rolls_back_and_restarts_on_a_new_base(tmp_path: Path) -> None:
    base_config, lora_config = configs(tmp_path)
    assert retrainer("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'registry.db'}", tmp=tmp_path).returncode == 0
    new_week(base_config, tmp_path, seed=101)
    assert run(base_config, tmp_path)["publish"]["version"] == 1  # base B = tiny-base v1
    base_v1 = versions("tiny-base", tmp_path)[1]

    # Week 1: nothing of tiny-lora is live: a fresh adapter on B.
    week1 = run(lora_config, tmp_path)
    assert week1["run"]["init"]["note"] == "fresh adapter on base tiny-base v1 (production)"
    assert week1["publish"]["version"] == 1 and week1["publish"]["parent_version"] is None
    v1 = versions("tiny-lora", tmp_path)[1]
    assert (v1["base_version"], v1["base_digest"]) == (1, base_v1["artifact_digest"])
    assert v1["started_from"] == "fresh adapter on base tiny-base v1 (production)"

    # Week 2: new data, same base: v1's adapter continues.
    new_week(lora_config, tmp_path, seed=202)
    done = retrainer("run", str(lora_config), "--json", tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # Every rank loads v1's adapter slices it holds (4 targets x 2 tensors x 2 layers on the one rank).
    assert "LoRA: continuing the adapter of tiny-lora v1 (live on production) (16 tensors on this rank)" in \
        done.stderr, "\n".join(line for line in done.stderr.splitlines() if "LoRA" in line)
    week2 = json.loads(done.stdout)
    assert week2["run"]["init"]["version"] == 1 and week2["run"]["base"]["digest"] == base_v1["artifact_digest"]
    assert week2["experiment_key"] != week1["experiment_key"]
    assert week2["publish"]["version"] == 2 and week2["publish"]["parent_version"] == 1
    live = week2["evaluate"]["live"]  # the gate scored live v1 (an adapter alone) as B + its adapter
    assert live["version"] == 1 and not live["cached"] and live["metrics"]["heldout.loss"] > 0
    assert versions("tiny-lora", tmp_path)[2]["base_digest"] == base_v1["artifact_digest"]

    # The operator rolls tiny-lora back to v1, as any version.
    back = retrainer("rollback", "--model", "tiny-lora", "--db", f"sqlite:///{tmp_path / 'registry.db'}",
                     "--reason", "bad answers", tmp=tmp_path)
    assert back.returncode == 0 and "version 2 -> version 1" in back.stdout, back.stderr

    # The base is retrained (B v2 goes live): the next LoRA run starts a fresh adapter on it and says why.
    new_week(base_config, tmp_path, seed=303)
    assert run(base_config, tmp_path)["publish"]["version"] == 2
    base_v2 = versions("tiny-base", tmp_path)[2]
    done = retrainer("run", str(lora_config), "--json", tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting a fresh adapter on base tiny-base v2 (production): the base changed since v1" in done.stderr
    week3 = json.loads(done.stdout)
    assert week3["run"]["init"]["note"] == "fresh adapter on base tiny-base v2 (production)"
    assert week3["publish"]["version"] == 3 and week3["publish"]["parent_version"] is None
    v3 = versions("tiny-lora", tmp_path)[3]
    assert (v3["base_version"], v3["base_digest"]) == (2, base_v2["artifact_digest"])
