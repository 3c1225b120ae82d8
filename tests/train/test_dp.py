"""DP-only training through the CLI and the real launcher (torchrun, 2 gloo ranks): summary, checkpoints, telemetry."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.launch.torchrun import node_command
from tasks.models import get_family
from tasks.models.weights import load_reference
from tasks.runs.identity import for_dataset
from tasks.train import checkpoint as ck

pytestmark = pytest.mark.multiproc


def test_cli_dp2_run_commits_checkpoints_and_summary(make_config, dataset_dir: Path, tmp_path: Path) -> None:
    written = make_config({"parallel.dp": 2, "train.steps": 50, "train.checkpoint_every": 2, "train.keep_last": 2,
                           "model.dropout": 0.1})
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(written.model_dump(mode="json")))
    cfg = written.with_overrides({"train.steps": 6})  # what --steps 6 runs
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True)
    (out / "summary.json").write_text('{"stale": true}')  # must never survive into this run

    done = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "train", str(config_path), "--dataset-dir", str(dataset_dir),
         "--steps", "6", "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)

    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    run = for_dataset(cfg, dataset_dir)
    assert summary["experiment_key"] == run.experiment_key
    assert summary["trained_steps"] == 6 and summary["started_from"] == run.init.note
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert all(math.isfinite(x) for x in summary["losses"])
    assert summary["final_loss"] == summary["losses"][-1]
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["world_size"] == 2 and summary["layout"] == {"tp": 1, "pp": 1, "dp": 2}
    assert summary["resumed_from_step"] is None

    root = ck.ckpt_root(out)
    assert ck.read_latest(root) == "step-000006" == summary["checkpoint_tag"]
    committed = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert committed == ["step-000004", "step-000006"]  # keep_last=2 pruned step 2
    assert not list(root.glob("tmp-*"))
    marker = json.loads((root / "step-000006" / ck.MARKER).read_text())
    assert marker == {"tag": "step-000006", "step": 6, "experiment_key": run.experiment_key,
                      "config_fingerprint": cfg.fingerprint(), "run": run.to_dict(), "world_size": 2,
                      "layout": {"tp": 1, "pp": 1, "dp": 2}}
    for rank in range(2):
        state = ck.load_rank_state(root / "step-000006", rank)
        assert state["data_position"]["step"] == 6 and "torch" in state["rng"]

    weights = root / "step-000006"
    assert summary["checkpoint_dir"] == str(weights)
    model = load_reference(weights, cfg.model)  # from the layer files: no consolidated copy in a checkpoint
    n = get_family(cfg.model.family).total_params(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == n
    assert not list(weights.glob("*consolidated*"))
    # the layer files hold each tensor with its own storage, not a view into ZeRO's flat buffer
    assert sum(p.stat().st_size for p in weights.glob("layer_*")) < 4 * n + 64_000

    rows = [json.loads(line) for line in Path(summary["telemetry_path"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == summary["losses"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["comm_s"] > 0  # DP=2 all-reduces gradients every step, and that time is measured
        assert r["compute_s"] >= 0 and abs(r["compute_s"] + r["comm_s"] - r["step_s"]) < 1e-6


def test_node_command_matches_layout(make_config, tmp_path: Path) -> None:
    cfg = make_config({"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "cluster.master_port": 29611})
    cmd = node_command(cfg, tmp_path / "ds", tmp_path / "cfg.json")
    assert "--nproc-per-node=8" in cmd and "--master-port=29611" in cmd and "--nnodes=1" in cmd
    assert cmd[cmd.index("-m", 3) + 1:cmd.index("-m", 3) + 3] == ["tasks.train.start", "tasks.train.worker"]
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "cfg.json")
    assert cmd[cmd.index("--dataset-dir") + 1] == str(tmp_path / "ds")
    two_nodes = node_command(cfg, "ds", "c.json", nnodes=2, node_rank=1)
    assert "--nproc-per-node=4" in two_nodes and "--node-rank=1" in two_nodes
