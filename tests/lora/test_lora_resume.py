"""A LoRA run killed mid-training resumes bit for bit: same losses, same adapters, the base untouched.

Dropout on (the model's and the adapters'), dp=2: covers RNG states, data position, the adapters' optimizer
states and LR schedule, which the checkpoint carries like a full run's.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tasks.launch import train
from tasks.models.lora import adapter_full_shapes
from tasks.models.weights import open_weights, weights_digest
from tasks.train import checkpoint as ck
from tests.train.conftest import tiny_config, write_dataset
from tests.train.test_faults import _children, _rank_of, _reap, _start, _wait_for

pytestmark = pytest.mark.multiproc

EXPERIMENT = {"parallel.dp": 2, "train.steps": 6, "train.checkpoint_every": 3, "train.keep_last": 3,
              "model.dropout": 0.1, "train.lr": 1e-2,
              "train.lora": {"rank": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["qkv", "fc2"]}}


def test_sigkill_then_resume_of_a_lora_run_is_bitwise_exact(tmp_path: Path, hooked, monkeypatch) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    straight = train(tiny_config(tmp_path, EXPERIMENT, out="straight"), dataset)

    cfg = tiny_config(tmp_path, EXPERIMENT, out="killed")
    ckroot = ck.ckpt_root(cfg.train.output_dir)
    Path(cfg.train.output_dir).mkdir(parents=True)
    hooked(HOOK_STEP_DELAY_S="1.0")
    proc = _start(cfg, dataset)
    try:
        _wait_for(lambda: (ckroot / ck.LATEST).exists(), proc, "the step-3 checkpoint")
        os.kill({_rank_of(pid): pid for pid in _children(proc.pid)}[1], signal.SIGKILL)
    finally:
        rc = _reap(proc)
    assert rc != 0 and ck.read_latest(ckroot) == "step-000003"
    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    resumed = train(cfg, dataset)

    assert resumed["resumed_from_step"] == 3 and resumed["losses"] == straight["losses"]
    m = cfg.model
    got, want = open_weights(resumed["checkpoint_dir"], m), open_weights(straight["checkpoint_dir"], m)
    assert weights_digest(resumed["checkpoint_dir"], m) == weights_digest(straight["checkpoint_dir"], m)
    for name in adapter_full_shapes(m, cfg.train.lora):
        assert torch.equal(got.read(name), want.read(name)), name
