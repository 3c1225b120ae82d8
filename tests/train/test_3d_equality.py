"""3D equality: the DeepSpeed pipeline (TP x PP x DP ranks, gloo) matches the single-process reference.

Same initial weights (seeded per layer, sliced per TP rank), same global batches,
same optimizer: per-step losses and gradient norms must agree within 1e-5 / 1e-4 relative, and so must the
final weights read back from the checkpoint's layer files (which also checks TP
un-sharding and stage merging). GPT; Llama with tied vocabulary-parallel embeddings split across two stages;
Qwen3-MoE's and Mixtral's routed experts split over TP with dense layers between them, and over two
expert-parallel ranks. Qwen3, Mistral, Gemma 3 and Gemma 2 get the same check from imported weights, in the one
tp=2 x pp=2 run each already has (tests/models/test_hf_import_export.py). Four of the layouts recompute their
blocks' activations in backward (train.activation_checkpointing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.launch import train
from tasks.models.weights import open_weights
from tasks.train.reference import train_reference
from tests.train.test_tracking import scalars

pytestmark = pytest.mark.multiproc

# No pp2-dp2 run of its own: pp2-tp2-dp2 has that pipeline and data parallelism, with tp on top.
LAYOUTS = {
    "pp2-tp2-dp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp": 2, "parallel.micro_batches": 2},
    # With activation checkpointing (the blocks recompute in backward): the same losses and weights.
    "tp2": {"parallel.tp": 2, "train.activation_checkpointing": True},
    "llama-tied-pp2-tp2": {"model.family": "llama", "model.tie_embeddings": True, "parallel.pp": 2,
                           "parallel.tp": 2, "parallel.micro_batches": 2, "train.activation_checkpointing": True},
    # A mixture of experts at ep=1: every expert split over TP along its hidden units, the router replicated;
    # layers 1 and 3 route (decoder_sparse_step), 0 and 2 are dense, so each stage holds both kinds.
    "qwen3_moe-pp2-tp2": {"model.family": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 4,
                          "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16,
                          "model.decoder_sparse_step": 2, "parallel.pp": 2, "parallel.tp": 2,
                          "parallel.micro_batches": 2},
    # Mixtral with transformers' auxiliary load-balancing loss across two stages, each split over two TP ranks: each
    # layer's aux gradient needs every layer's routing, later stages' included (RouterAux); its blocks recompute
    # in backward, which must neither change the aux gradient nor count a token's routing twice.
    "mixtral-aux-pp2-tp2": {"model.family": "mixtral", "model.num_experts": 4, "model.num_experts_per_tok": 2,
                            "model.norm_topk_prob": True, "model.router_aux_loss_coef": 0.5, "parallel.pp": 2,
                            "parallel.tp": 2, "parallel.micro_batches": 2, "train.activation_checkpointing": True},
    # Expert parallelism: each MoE layer's 4 experts split over 2 of the data-parallel ranks (tokens dispatched by
    # all-to-all, the experts' gradients reduced over the ranks holding the same experts), under a pipeline, with
    # the auxiliary loss, recomputing its blocks in backward (the recompute's all-to-alls run on every rank of the
    # group in the same order); the gradient norm checks the experts' gradient scale, which Adam's steps would hide.
    "qwen3_moe-aux-pp2-dp2-ep2": {"model.family": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 4,
                                  "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16,
                                  "model.norm_topk_prob": True, "model.router_aux_loss_coef": 0.5,
                                  "parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.micro_batches": 2,
                                  "train.activation_checkpointing": True},
    # Mixtral's router (always renormalised) over the same expert-parallel dispatch, without recompute.
    "mixtral-aux-pp2-dp2-ep2": {"model.family": "mixtral", "model.num_experts": 4, "model.num_experts_per_tok": 2,
                                "model.norm_topk_prob": True, "model.router_aux_loss_coef": 0.5, "parallel.pp": 2,
                                "parallel.dp": 2, "parallel.ep": 2, "parallel.micro_batches": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_reference(layout: str, make_config, dataset_dir: Path) -> None:
    cfg = make_config({**LAYOUTS[layout], "train.steps": 6, "train.checkpoint_every": 6,
                       "model.n_layers": 4, "train.micro_batch_size": 2})
    summary = train(cfg, dataset_dir)
    ref = train_reference(cfg, dataset_dir)

    assert len(summary["losses"]) == len(ref.losses) == 6
    assert ref.losses[-1] < ref.losses[0]  # it trains: equality is not between two constants
    for step, (got, want) in enumerate(zip(summary["losses"], ref.losses, strict=True), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: 3D loss {got} vs reference {want}"

    norms = [value for _, value in scalars(Path(summary["telemetry_path"]).parent)["train/grad_norm"]]
    for step, (got, want) in enumerate(zip(norms, ref.grad_norms, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * want, f"step {step}: 3D gradient norm {got} vs reference {want}"

    rows = [json.loads(line) for line in Path(summary["telemetry_path"]).read_text().splitlines()]
    m, p = cfg.model, cfg.parallel
    if m.num_experts is not None:  # each step's routing per MoE layer, every stage's: each token's k picks once
        picks = cfg.train.micro_batch_size * p.micro_batches * p.dp * m.seq_len * m.num_experts_per_tok
        for row in rows:
            assert sorted(map(int, row["expert_load"])) == [i for i in range(m.n_layers) if m.routed(i)], row
            for load in row["expert_load"].values():
                assert load["mean"] * m.num_experts == picks and load["min"] <= load["mean"] <= load["max"], row
        board = scalars(Path(summary["telemetry_path"]).parent)  # and in TensorBoard, as max / mean per layer
        for layer, load in rows[-1]["expert_load"].items():
            assert board[f"moe/layer_{layer}/max_load"][-1] == (6, pytest.approx(load["max"] / load["mean"]))
    else:
        assert not any("expert_load" in row for row in rows)

    weights = open_weights(summary["checkpoint_dir"], cfg.model)
    want_state = ref.model.state_dict()
    state = {name: weights.read(name) for name in want_state}
    for name, tensor in want_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
