"""A LoRA run killed mid-training resumes bit for bit: same losses, same adapters, the base untouched.

Dropout on (the model's and the adapters'), dp=2: covers RNG states, data position, the adapters' optimizer
states and LR schedule, which the checkpoint carries like a full run's. The run starts from base weights, so
its checkpoints hold only the adapters and their optimizer states; the resume takes the base from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.launch import train
from tasks.models import get_family
from tasks.models.lora import adapter_full_shapes
from tasks.models.weights import open_weights, weights_digest
from tests.checkpoints import write_base_weights
from tests.train.conftest import tiny_config, write_dataset
from tests.train.test_faults import kill_a_rank_after_step_3

pytestmark = pytest.mark.multiproc

EXPERIMENT = {"parallel.dp": 2, "train.steps": 6, "train.checkpoint_every": 3, "train.keep_last": 3,
              "model.dropout": 0.1, "train.lr": 1e-2,
              "train.lora": {"rank": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["qkv", "fc2"]}}


def test_sigkill_then_resume_of_a_lora_run_is_bitwise_exact(tmp_path: Path, hooked, monkeypatch) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    base = write_base_weights(tiny_config(tmp_path, EXPERIMENT).model, tmp_path / "base")
    straight = train(tiny_config(tmp_path, EXPERIMENT, out="straight"), dataset, init_path=base)

    cfg = tiny_config(tmp_path, EXPERIMENT, out="killed")
    kill_a_rank_after_step_3(cfg, dataset, hooked, init_path=base)
    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    resumed = train(cfg, dataset, init_path=base)

    assert resumed["resumed_from_step"] == 3 and resumed["losses"] == straight["losses"]
    m = cfg.model
    got, want = open_weights(resumed["checkpoint_dir"], m), open_weights(straight["checkpoint_dir"], m)
    assert weights_digest(resumed["checkpoint_dir"], m) == weights_digest(straight["checkpoint_dir"], m)
    for name in adapter_full_shapes(m, cfg.train.lora):
        assert torch.equal(got.read(name), want.read(name)), name

    # The checkpoint is adapter-sized: no base tensor in its model files, a fraction of the base's bytes.
    model_files = sorted(Path(resumed["checkpoint_dir"]).glob("layer_*-model_states.pt"))
    saved = [n for f in model_files for n in torch.load(f, weights_only=True)]
    assert saved and not set(saved) & set(get_family(m.family).full_shapes(m))
    assert sum(f.stat().st_size for f in model_files) < base.stat().st_size / 4
    for name, tensor in torch.load(base, weights_only=True).items():  # the base, read from where it is, untouched
        assert torch.equal(got.read(name), tensor), name
