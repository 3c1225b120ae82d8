"""The planner with train.lora: a frozen base in the training dtype, adapters with grads and Adam states."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.base.layout import Layout
from tasks.models import get_family
from tasks.models.lora import apply_lora
from tasks.models.parallel import TPGroup
from tasks.plan import plan, search
from tests.plan.conftest import make_config
from tests.plan.test_measured import MODEL as MEASURED
from tests.plan.test_measured import run_layout

# The demo GPT (d=64, 4 heads, kv 4, ffn 256, 4 layers): 236928 parameters (tests/plan/test_formulas.py).
DEMO = {"family": "gpt", "vocab_size": 256, "seq_len": 64, "n_layers": 4, "d_model": 64, "n_heads": 4,
        "n_kv_heads": 4, "d_ff": 256}
LORA = {"rank": 8, "alpha": 16, "target_modules": ["qkv", "out", "fc1", "fc2"]}


def test_lora_memory_terms_by_hand() -> None:
    cfg = make_config(model=DEMO, parallel={"dp": 4, "zero_stage": 1}, train={"precision": "bf16", "lora": LORA})
    r = plan(cfg)
    base = 236928
    # per block, r = 8: qkv 8*64 + 192*8 = 2048, out 8*64 + 64*8 = 1024, fc1 8*64 + 256*8 = 2560, fc2 2560: 8192
    adapters = 4 * 8192
    assert r.memory.weights == 2 * (base + adapters)  # the frozen base is held in the training dtype
    assert r.memory.gradients == 2 * adapters + 4 * (adapters // 4)  # bf16 grads + fp32 partition grad
    assert r.memory.optimizer_states == 12 * (adapters // 4)  # ZeRO-1: fp32 master + 2 moments, 1/dp
    full = plan(cfg.with_overrides({"train.lora": None}))
    assert r.memory.total < full.memory.total


def test_a_lora_save_on_base_weights_snapshots_only_the_adapters() -> None:
    """exclude_frozen_parameters: a LoRA run on model.pretrained (or model.base) checkpoints the adapters and
    their optimizer states; on a seeded base, and in a full run, every weight (a GPU rank's host snapshot)."""
    train = {"precision": "fp32", "lora": LORA}
    seeded = make_config(model=DEMO, parallel={"dp": 2, "zero_stage": 1}, train=train)
    on_base = make_config(model={**DEMO, "pretrained": "/nonexistent/hf"}, parallel={"dp": 2, "zero_stage": 1},
                          train=train)
    base, adapters = 236928, 4 * 8192
    optim = 12 * (adapters // 2)  # ZeRO-1, fp32: master + 2 moments of the adapters' partition
    assert plan(on_base, device="gpu").memory.checkpoint_snapshot == 4 * adapters + optim
    assert plan(seeded, device="gpu").memory.checkpoint_snapshot == 4 * (base + adapters) + optim
    full = on_base.with_overrides({"train.lora": None})
    assert plan(full, device="gpu").memory.checkpoint_snapshot == 4 * base + 12 * (base // 2)
    # A CPU rank's snapshot copies the weights it keeps; it writes the optimizer states where they live.
    assert plan(on_base, device="cpu").memory.checkpoint_snapshot == 4 * adapters
    assert plan(full, device="cpu").memory.checkpoint_snapshot == 4 * base


def test_the_counted_adapters_are_the_ones_a_tp_rank_builds() -> None:
    """column-parallel qkv/fc1 (B split), row-parallel out/fc2 (A split), counted as the model holds them."""
    for tp in (1, 2):
        cfg = make_config(model={**DEMO, "n_layers": 1}, parallel={"tp": tp}, train={"lora": LORA})
        block = get_family("gpt").TransformerBlock(cfg.model, 0, 0, TPGroup(None, Layout(tp=tp)))
        apply_lora(block, cfg.model, cfg.train.lora, TPGroup(None, Layout(tp=tp)), 0)
        held = sum(p.numel() for p in block.parameters() if p.requires_grad)
        assert plan(cfg, world_size=tp).stages[0]["trained_params"] == held


def test_search_finds_smaller_layouts_with_lora() -> None:
    """An 8B-class Llama on 80 GiB GPUs: full fine-tuning (16 B/param) needs more GPUs than one; a LoRA
    adapter on its frozen bf16 base fits one GPU."""
    llama8b = {"family": "llama", "vocab_size": 128256, "seq_len": 2048, "n_layers": 32, "d_model": 4096,
               "n_heads": 32, "n_kv_heads": 8, "d_ff": 14336}
    full = make_config(model=llama8b, train={"precision": "bf16", "micro_batch_size": 1,
                                             "activation_checkpointing": True},
                       cluster={"host_memory_gib": 1024})  # a GPU node's host memory, not this machine's
    lora = full.with_overrides({"train.lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}})
    assert search(full, 1, device="gpu") == []
    found = search(lora, 1, device="gpu")
    assert found and found[0].fits and found[0].memory.total < 80 * 1024**3


@pytest.mark.multiproc
def test_a_lora_engine_holds_what_the_plan_predicts(tmp_path: Path) -> None:
    """tp=2 x dp=2 ZeRO-1 with adapters on every linear: per rank, parameters, weights, gradients (only the
    adapters') and optimizer states (the adapters' partition) within 2% of the planner (tests/plan's
    measurement worker)."""
    layout = {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 1, "micro_batches": 1}
    cfg = make_config(model=MEASURED, parallel=layout, train={"precision": "fp32", "micro_batch_size": 2,
                                                              "lora": LORA})
    predicted = plan(cfg)
    full = plan(cfg.with_overrides({"train.lora": None}))
    for r in run_layout(layout, tmp_path / "ranks", model=MEASURED, lora_rank=LORA["rank"]):
        stage, where = predicted.stages[r["stage"]], f"rank {r['rank']}"
        assert r["params"] == stage["params"], where
        mem = r["memory"]
        for term, measured in (("weights", mem["at_inner_step"]["weights"]),
                               ("gradients", mem["after_backward"]["gradients"]),
                               ("optimizer_states", mem["at_inner_step"]["optimizer_states"])):
            assert abs(measured - stage[term]) <= 0.02 * stage[term], f"{where}: {term} {measured} vs {stage[term]}"
            if term != "weights":  # what LoRA saves: the base's gradients and optimizer states
                assert measured < 0.5 * full.stages[r["stage"]][term], term
