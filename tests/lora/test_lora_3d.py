"""LoRA in 3D: tp=2 x pp=2 ranks train the same adapters as the single-process reference, on a frozen base.

One multi-process run (the suite stays fast) checks everything the engine must get right: per-step losses
within 1e-5 of the reference, the base weights in the checkpoint bit-identical to the initial ones, the
adapters equal to the reference's, and only adapter parameters in every rank's optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.launch import train
from tasks.models.lora import is_adapter_param
from tasks.models.weights import open_weights
from tasks.train.reference import train_reference

pytestmark = pytest.mark.multiproc

# Column-parallel (q, gate) and row-parallel (o, down) targets: both sharding rules, on a GQA Llama.
LORA = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "o_proj", "gate_proj", "down_proj"]}


def test_lora_tp2_pp2_matches_the_reference_with_the_base_frozen(make_config, dataset_dir: Path, hooked,
                                                                 tmp_path: Path) -> None:
    optimizer_dir = tmp_path / "optimizer"
    hooked(HOOK_OPTIMIZER_PARAMS=str(optimizer_dir))
    cfg = make_config({"model.family": "llama", "parallel.tp": 2, "parallel.pp": 2, "parallel.micro_batches": 2,
                       "model.n_layers": 4, "train.micro_batch_size": 2, "train.steps": 6,
                       "train.checkpoint_every": 6, "train.lr": 1e-2, "train.lora": LORA})
    summary = train(cfg, dataset_dir)
    ref = train_reference(cfg, dataset_dir)

    assert ref.losses[-1] < ref.losses[0]  # the adapters train: equality is not between two constants
    for step, (got, want) in enumerate(zip(summary["losses"], ref.losses, strict=True), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: 3D loss {got} vs reference {want}"

    weights = open_weights(summary["checkpoint_dir"], cfg.model)
    state = ref.model.state_dict()  # the reference's base never trains: its tensors are the initial weights
    adapters = sorted(n for n in state if is_adapter_param(n))
    assert len(adapters) == 2 * 4 * cfg.model.n_layers
    for name in sorted(set(state) - set(adapters)):
        assert torch.equal(weights.read(name), state[name]), f"{name}: the frozen base weight changed"
    # Adam moves an element whose gradient is ~0 by up to lr whichever way rounding tips it (the first steps'
    # A gradients are tiny: B starts at zero), so the adapters agree to a small fraction of one step.
    for name in adapters:
        torch.testing.assert_close(weights.read(name), state[name], rtol=1e-4, atol=0.05 * cfg.train.lr,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert all(weights.read(n).abs().sum() > 0 for n in adapters)  # B moved off zero: every adapter trained

    records = [json.loads(p.read_text()) for p in sorted(optimizer_dir.glob("rank-*.json"))]
    assert len(records) == 4
    for record in records:
        assert record["optimized"] and all(is_adapter_param(n) for n in record["optimized"]), record
        assert record["outside"] and not any(is_adapter_param(n) for n in record["outside"]), record
        assert record["unnamed_in_optimizer"] == 0
    assert sorted({n for r in records for n in r["optimized"]}) == adapters
