"""Tensor parallelism on real processes: 2 gloo ranks, the tp=2 Llama-style layers (Llama, Qwen3, Mistral)
against the tp=1 Reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import REPO_ROOT
from tests.models.tp_worker import CONFIGS
from tests.services import free_port

ROOT = REPO_ROOT
WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.mark.multiproc
def test_tp2_layers_match_the_reference(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tasks.base.spawn", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(WORKER), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(report) == set(CONFIGS)
        for name, r in report.items():
            vocab, d = CONFIGS[name]["vocab_size"], CONFIGS[name]["d_model"]
            # Each rank holds vocab/tp rows of the embedding and of the LM head (tied: one matrix).
            assert r["shapes"]["embed.tok.weight"] == [vocab // 2, d]
            tied = CONFIGS[name].get("tie_embeddings", False)
            assert ("head.out.weight" in r["shapes"]) == (not tied)
            if not tied:
                assert r["shapes"]["head.out.weight"] == [vocab // 2, d]
            assert r["local_logits_shape"] == [2, CONFIGS[name]["seq_len"], vocab // 2]
            assert r["logits"] <= 1e-5, (rank, name, r)
            assert r["argmax"], (rank, name)  # each position's greedy token over both vocab slices
            assert r["loss"] <= 1e-6, (rank, name, r)
            if CONFIGS[name].get("qk_norm"):  # replicated, head_dim wide, on every rank
                assert r["shapes"]["blocks.0.attn.q_norm.weight"] == [CONFIGS[name]["head_dim"]]
                assert "blocks.0.attn.q_norm.weight" in r["grads"]
            for weight, g in r["grads"].items():  # absolute, and relative to a non-vanishing gradient
                assert g["diff"] <= 1e-5 and g["diff"] <= 1e-4 * g["scale"], (rank, name, weight, g)
