"""Each planner term against arithmetic worked by hand (shown in the test)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tasks.base.dataset_format import PlannedData
from tasks.base.errors import ConfigError
from tasks.base.layout import Layout
from tasks.models import get_family
from tasks.models.parallel import TPGroup
from tasks.models.shapes import EVALUATION_PARTITION, TRAINING_PARTITION, pipeline_stages
from tasks.plan import plan, search, serving_estimate
from tasks.plan.evaluation import EVAL_RUNTIME_BYTES, HARNESS_RUNTIME_BYTES
from tasks.plan.process import RUNTIME_BYTES
from tasks.plan.render import render
from tests.plan.conftest import make_config

# d=64, heads=4 (hd=16), kv=4, ffn=256, vocab=256, seq=64, 4 layers: the demo model.
DEMO = {"family": "gpt",
        "vocab_size": 256, "seq_len": 64, "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "d_ff": 256}
GPT_FAMILY = get_family("gpt")


def test_param_count_exact_by_hand() -> None:
    cfg = make_config(model=DEMO)
    # embedding: 256*64 tok + 64*64 pos = 16384 + 4096 = 20480
    # block: ln1 128 + qkv (64*192 + 192 = 12480) + out (64*64 + 64 = 4160) + ln2 128
    #        + fc1 (64*256 + 256 = 16640) + fc2 (256*64 + 64 = 16448) = 49984
    # head: ln 128 + 64*256 = 16512
    c = GPT_FAMILY.param_counts(cfg.model)
    assert (c.embedding, c.block, c.head) == (20480, 49984, 16512)
    assert GPT_FAMILY.total_params(cfg.model) == 20480 + 4 * 49984 + 16512 == 236928


def test_param_count_matches_the_real_model() -> None:
    from tasks.models.gpt.model import Reference as GPT

    for model in (DEMO, {**DEMO, "n_kv_heads": 2, "d_ff": 96, "n_layers": 3}):
        cfg = make_config(model=model)
        assert GPT_FAMILY.total_params(cfg.model) == sum(p.numel() for p in GPT(cfg.model).parameters())


def test_tp_shards_column_and_row_weights_but_not_norms_or_row_biases() -> None:
    cfg = make_config(model={**DEMO, "n_kv_heads": 2}, parallel={"tp": 2})
    # qkv out = (4 + 2*2)*16 = 128: weight 64*128 + bias 128 = 8320 -> 4160 per rank
    # out: 64*64 = 4096 -> 2048, its bias 64 replicated; fc1 16640 -> 8320; fc2 weight 16384 -> 8192, bias 64
    # replicated: 2 LNs 256 + 64 + 64 = 384;  per rank: 384 + 4160 + 2048 + 8320 + 8192 = 23104
    assert GPT_FAMILY.param_counts(cfg.model, Layout(tp=2)).block == 23104


def test_pipeline_stages_follow_deepspeed_type_partition() -> None:
    # 5 blocks over 2 stages: DeepSpeed gives [embed, b0, b1, b2 | b3, b4, head]
    stages = pipeline_stages(5, 2)
    assert [(s.blocks, s.has_embedding, s.has_head) for s in stages] == [(3, True, False), (2, False, True)]
    assert [s.blocks for s in pipeline_stages(6, 4)] == [2, 2, 1, 1]


@pytest.mark.parametrize(("family", "tied"), [("gpt", False), *((f, t) for f in ("llama", "qwen3", "mistral", "gemma3",
                                                                                "gemma2") for t in (False, True))])
def test_pipeline_stages_are_what_deepspeed_builds_from_each_familys_layers(family: str, tied: bool) -> None:
    """Both partitions, as DeepSpeed's PipelineModule reads them (its name regex over the family's real layer
    classes, its balancer), against `pipeline_stages`, which the planner and export use."""
    import regex
    from deepspeed.runtime.utils import partition_balanced

    model = {**DEMO, "family": family, "n_layers": 7, **({"tie_embeddings": True} if tied else {}),
             **({"qk_norm": True} if family in ("qwen3", "gemma3") else {})}
    m = make_config(model=model).model
    specs = get_family(family).pipeline_layers(m, None, TPGroup())
    names = [spec.typename.__name__ for spec in specs]
    for partition in (TRAINING_PARTITION, EVALUATION_PARTITION):
        pattern = regex.compile(partition.split(":")[1], regex.IGNORECASE)
        for pp in (2, 3, 4):
            parts = partition_balanced(weights=[1 if pattern.search(n) else 0 for n in names], num_parts=pp)
            built = [names[parts[i]:parts[i + 1]] for i in range(pp)]
            got = [(held.count("TransformerBlock"), "Head" in held) for held in built]
            want = [(s.blocks, s.has_head) for s in pipeline_stages(m.n_layers, pp, partition)]
            assert got == want, (partition, pp, built)
    # Evaluation weighs the head as a block: 7 blocks + head over 2 stages is 4 | 3 + head, not 4 | 3 alone
    assert [(s.blocks, s.has_head) for s in pipeline_stages(20, 2, EVALUATION_PARTITION)] == [(11, False), (9, True)]
    assert [(s.blocks, s.has_head) for s in pipeline_stages(20, 2)] == [(10, False), (10, True)]


def test_memory_terms_bf16_zero1_by_hand() -> None:
    cfg = make_config(model=DEMO, parallel={"dp": 4, "zero_stage": 1}, train={"precision": "bf16"})
    r = plan(cfg)
    n = 236928
    assert r.memory.weights == 2 * n == 473856
    # full bf16 grads until the reduction + fp32 grad of the 1/4 partition: 2n + 4 * n/4 = 3n
    assert r.memory.gradients == 2 * n + 4 * (n // 4) == 710784
    # fp32 master + 2 moments over 4 ranks: 12 * n / 4 = 3n
    assert r.memory.optimizer_states == 12 * (n // 4) == 710784
    # ZeRO-0 keeps all 12 B/param; ZeRO-3 also splits the weights.
    r0 = plan(cfg.with_overrides({"parallel.zero_stage": 0}))
    assert r0.memory.optimizer_states == 12 * n and r0.memory.gradients == 2 * n
    r3 = plan(cfg.with_overrides({"parallel.zero_stage": 3}))
    assert r3.memory.weights == 2 * (n // 4)


def test_memory_terms_fp32_zero0_and_zero1() -> None:
    n = 236928
    r0 = plan(make_config(model=DEMO, parallel={"dp": 2, "zero_stage": 0}, train={"precision": "fp32"}))
    # fp32, plain AdamW: 4 B weights, 4 B grads, 8 B moments (no master copy)
    assert (r0.memory.weights, r0.memory.gradients, r0.memory.optimizer_states) == (4 * n, 4 * n, 8 * n)
    r1 = plan(make_config(model=DEMO, parallel={"dp": 2, "zero_stage": 1}, train={"precision": "fp32"}))
    # ZeRO-1 keeps an fp32 copy of its half + 2 moments: 12 * n/2
    assert r1.memory.optimizer_states == 12 * (n // 2) == 1421568


def test_activations_match_korthikanti_formula_for_standard_shapes() -> None:
    # bf16, ffn = 4h, dropout on, tp=1: 34 s b h + 5 a s^2 b per layer.
    model = {**DEMO, "dropout": 0.1, "n_layers": 2}
    cfg = make_config(model=model, train={"precision": "bf16", "micro_batch_size": 2})
    s, b, h, a, v = 64, 2, 64, 4, 256
    per_layer = 34 * s * b * h + 5 * a * s * s * b  # 278528 + 163840 = 442368
    embed_out = 2 * s * b * h
    head = 2 * 2 * s * b * h + 2 * s * b * v + 4 * s * b * v  # final LN in/out, logits, fp32 softmax
    mat = plan(cfg, attention="materialized")
    assert mat.memory.activations_without_recompute == 2 * per_layer + embed_out + head
    # recomputation: keep 2 s b h per layer input + one layer rebuilt at a time
    assert mat.memory.activations_with_recompute == 2 * (2 * s * b * h) + per_layer + embed_out + head
    # with tp=2 (no sequence parallel): 10 s b h + (24 s b h + 5 a s^2 b)/2
    tp2 = plan(cfg.with_overrides({"parallel.tp": 2}), attention="materialized")
    per_layer_tp2 = 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // 2
    assert tp2.memory.activations_without_recompute == 2 * per_layer_tp2 + embed_out + head
    # fused SDPA (our model): the 5 a s^2 b scores become an fp32 log-sum-exp, 4 a s b
    sdpa = plan(cfg)
    assert sdpa.memory.activations_without_recompute == 2 * (34 * s * b * h + 4 * a * s * b) + embed_out + head


def test_packed_conversations_add_their_ids_and_document_masks() -> None:
    """A chat dataset's windows: per in-flight micro-batch the int64 position and document ids (2 x 8 x s b),
    per stage the boolean document masks (three of b s^2: two kept, one being built) and the causal s^2."""
    cfg = make_config(model=DEMO, parallel={"pp": 2, "micro_batches": 4}, train={"micro_batch_size": 2})
    plain, packed = plan(cfg), plan(cfg, data=PlannedData(packed=True))
    s, b = 64, 2
    for stage, in_flight in ((0, 2), (1, 1)):  # 1F1B: min(micro_batches, pp - stage)
        added = packed.stages[stage]["activations"] - plain.stages[stage]["activations"]
        assert added == in_flight * 2 * 8 * s * b + 3 * b * s * s + s * s == in_flight * 2048 + 28672


def test_step_comm_flops_and_bubble_by_hand() -> None:
    cfg = make_config(
        model=DEMO, parallel={"tp": 2, "pp": 2, "dp": 2, "zero_stage": 0, "micro_batches": 6},
        # grad_clip 0: JobConfig refuses tp > 1 with ZeRO-0 and clipping (DeepSpeed clips wrongly there).
        train={"precision": "bf16", "micro_batch_size": 2, "grad_clip": 0.0},
        cluster={"gpus_per_node": 8, "intra_node_gbytes_per_s": 100, "peak_tflops": 100, "assumed_mfu": 0.5},
    )
    r = plan(cfg)
    st = r.step
    # bubble (p-1)/(m+p-1) = 1/7
    assert st.bubble_fraction == pytest.approx(1 / 7)
    # tokens = mbs 2 x m 6 x dp 2 x seq 64 = 1536; FLOPs = the family's per token (6N + 12 L s h, N without the
    # 20480 embedding lookup parameters) x tokens
    assert st.tokens_per_step == 1536
    assert st.flops_total == GPT_FAMILY.flops_per_token(cfg.model) * 1536 == (6 * (236928 - 20480)
                                                                               + 12 * 4 * 64 * 64) * 1536
    recomputed = plan(cfg.with_overrides({"train.activation_checkpointing": True})).step
    assert recomputed.flops_total == pytest.approx(st.flops_total * 4 / 3)  # each forward once more
    # stage 0 (embed + 2 blocks) per TP rank: 20480 + 2 * block_tp2
    block_tp2 = 128 * 2 + 64 + 64 + (12480 + 4096 + 16640 + 16384) // 2  # 25184
    n0 = 20480 + 2 * block_tp2
    assert r.params_per_rank == n0 == 70848
    # ZeRO-0 ring all-reduce: payload 2 B x n0, wire 2 (N-1)/N x payload = payload for N = 2
    assert st.dp_grad_payload_bytes == 2 * n0 and st.dp_ring_bytes == 2 * n0
    # TP: 4 all-reduces of s b h bf16 per block per micro-batch: 4 x 2 x 64 x 2 x 64 x 2 blocks x 6
    assert st.tp_payload_bytes == 4 * 2 * 64 * 2 * 64 * 2 * 6
    # PP: activation forward + gradient back, s b h bf16 each, per micro-batch
    assert st.pp_p2p_bytes == 2 * 2 * 64 * 2 * 64 * 6
    # all groups inside one node of 8: 100 GB/s
    assert st.comm_s == pytest.approx((st.dp_ring_bytes + st.tp_collective_bytes + st.pp_p2p_bytes) / 100e9)
    compute = st.flops_total / 8 / (100e12 * 0.5)
    assert st.compute_s == pytest.approx(compute)
    assert st.step_s == pytest.approx(compute * 7 / 6 + st.comm_s)
    assert st.comm_share == pytest.approx(st.comm_s / st.step_s)


def test_inter_node_links_slow_the_dp_reduction() -> None:
    base = {"model": DEMO, "parallel": {"dp": 16}, "train": {"precision": "bf16"}}
    inside = plan(make_config(**base, cluster={"gpus_per_node": 16, "intra_node_gbytes_per_s": 400}))
    two_nodes = {"launcher": "slurm", "slurm": {"nodes": 2}, "gpus_per_node": 8}
    across = plan(make_config(**base, cluster={**two_nodes, "inter_node_gbytes_per_s": 50}))
    # across nodes each GPU gets 50/8 GB/s instead of 400: 64x slower
    assert across.step.dp_comm_s == pytest.approx(inside.step.dp_comm_s * 64)
    # A 10 Gbit/s NIC is 1.25 GB/s per node: 40x slower than 50 GB/s, not "10 GB/s".
    nic = plan(make_config(**base, cluster={**two_nodes, "inter_node_gbits_per_s": 10}))
    assert nic.step.dp_comm_s == pytest.approx(across.step.dp_comm_s * 40)
    assert make_config(cluster={"inter_node_gbits_per_s": 10}).cluster.inter_node_bytes_per_s == 1.25e9


def test_does_not_fit_names_the_term_and_the_overflow() -> None:
    # 1.5B-ish model, bf16, one 16 GiB GPU: 12 B/param optimizer alone overflows
    big = {"vocab_size": 50304, "seq_len": 1024, "n_layers": 24, "d_model": 2048, "n_heads": 16}
    r = plan(make_config(model=big, train={"precision": "bf16", "micro_batch_size": 1},
                         cluster={"gpu_memory_gib": 16}))
    assert not r.fits and r.verdict == "does_not_fit"
    assert r.overflow is not None and r.overflow["term"] == "optimizer_states"
    assert r.overflow["by_bytes"] == r.memory.total - 16 * 1024**3 > 0


def test_warnings_for_bubble_and_communication() -> None:
    r = plan(make_config(model=DEMO, parallel={"pp": 4, "micro_batches": 1}, train={"precision": "bf16"}))
    # bubble 3/4 > 25%
    assert r.step.bubble_fraction == 0.75 and r.fits and r.verdict == "fits_with_warnings"
    assert any("bubble" in w for w in r.warnings)


def test_search_ranks_only_feasible_layouts_that_keep_the_global_batch() -> None:
    big = {"vocab_size": 32000, "seq_len": 1024, "n_layers": 16, "d_model": 2048, "n_heads": 16}
    cfg = make_config(model=big, parallel={"dp": 1, "zero_stage": 1, "micro_batches": 8},
                      train={"precision": "bf16", "micro_batch_size": 1},
                      cluster={"gpu_memory_gib": 16, "host_memory_gib": 1024})  # a GPU node's, not this machine's
    assert not plan(cfg).fits
    ranked = search(cfg, 8)
    assert ranked and all(r.fits for r in ranked)
    for r in ranked:
        lay = r.layout
        assert lay["tp"] * lay["pp"] * lay["dp"] == 8
        assert lay["micro_batch_size"] * lay["micro_batches"] * lay["dp"] == 8
    keys = [(bool(r.warnings), r.step.step_s) for r in ranked]
    assert keys == sorted(keys)


def test_serving_estimate_by_hand() -> None:
    cfg = make_config(model={**DEMO, "n_kv_heads": 2}, serving={"concurrency": 8, "context_len": 1000})
    est = serving_estimate(cfg)
    # KV per token: 4 layers x 2 kv heads x 16 hd x 2 (K, V) x 2 B = 512
    assert est["kv_cache_bytes_per_token"] == 512
    assert est["kv_cache_bytes"] == 512 * 8 * 1000
    n = GPT_FAMILY.total_params(cfg.model)
    assert est["weights_bytes"] == 2 * n
    assert est["serving_bytes"] == 2 * n + 4_096_000
    fp32 = cfg.with_overrides({"serving.dtype": "fp32", "serving.context_len": None})
    assert math.isclose(serving_estimate(fp32)["kv_cache_bytes_per_token"], 1024)
    assert serving_estimate(fp32)["context"] == 64  # model.seq_len by default


def test_process_peak_by_hand_a_save_before_the_last_step_overlaps_the_next_step() -> None:
    """A run saving before its last step trains on while the snapshot is written: a CPU rank waits for the write
    before the ZeRO step buffers, and its snapshot copies only the weights (the optimizer's tensors are written
    where they live), so its peak is the larger of the optimizer step and the forward and backward passes with
    the weights' copy on top; a run saving only at its end holds the snapshot beside the step's leftovers. The
    last stage keeps min(2, micro-batches) logits in DeepSpeed's pipe buffers throughout (issue 38)."""
    m = {"vocab_size": 4096, "seq_len": 16, "n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024}
    for every, snapshot_phase in ((5, "training + snapshot"), (10, "saving")):
        r = plan(make_config(model=m, parallel={"pp": 2, "micro_batches": 2},
                             train={"steps": 10, "checkpoint_every": every, "micro_batch_size": 1}), device="cpu")
        for st in r.stages:
            terms = st["process"]
            assert terms["runtime"] == RUNTIME_BYTES and terms["weights_file_pages"] == 0
            assert terms["checkpoint_snapshot"] == st["weights"]  # fp32 weights; the optimizer states stay put
            assert terms["pipe_outputs"] == (2 * 4 * 16 * 4096 if st["has_head"] else 0)  # 2 fp32 logits
            held = st["weights"] + st["gradients"] + st["optimizer_states"] + terms["pipe_outputs"]
            passes = st["activations"] + st["comm_buffers"]  # dp = 1: the pipeline's buffers, no reduce bucket
            phases = {"training": held + max(passes, terms["zero_step_buffers"]),
                      "loading": st["weights"],
                      "training + snapshot": held + passes + terms["checkpoint_snapshot"],
                      # after the optimizer step, whose zero_grad has dropped the gradients
                      "saving": st["weights"] + st["optimizer_states"] + terms["pipe_outputs"]
                      + terms["checkpoint_snapshot"]}
            expected = {name: phases[name] for name in ("training", "loading", snapshot_phase)}
            phase = max(expected, key=expected.__getitem__)
            assert st["process_phase"] == phase and st["process_total"] == RUNTIME_BYTES + expected[phase]
        ev = r.evaluation
        assert ev["runtime"] == EVAL_RUNTIME_BYTES and ev["weights_file_pages"] == 2 * ev["weights"]  # fp32 file, bf16
        assert ev["process_total"] == EVAL_RUNTIME_BYTES + max(ev["total"], ev["weights"] + ev["weights_file_pages"])
    # At dp = 2 the gradients' reduction has a moment of its own: its bucket is gone by the optimizer step.
    [st] = plan(make_config(model=m, parallel={"dp": 2}, train={"steps": 10, "checkpoint_every": 10}),
                device="cpu").stages
    terms, bucket = st["process"], 4 * st["params"]  # all of the gradients: fewer than DeepSpeed's bucket size
    assert st["comm_buffers"] == bucket and terms["zero_step_buffers"] == 2 * 4 * -(-st["params"] // 2)
    held = st["weights"] + st["gradients"] + st["optimizer_states"] + terms["pipe_outputs"]
    assert st["process_phase"] == "training"
    assert st["process_total"] == RUNTIME_BYTES + held + max(st["activations"], bucket, terms["zero_step_buffers"])
    gpu = plan(make_config(model=m, train={"steps": 10, "checkpoint_every": 5}), device="gpu")
    [gpu_stage] = gpu.stages  # a GPU rank's snapshot is a host copy of its weights and optimizer states
    assert gpu.memory.checkpoint_snapshot == gpu_stage["weights"] + gpu_stage["optimizer_states"]
    assert gpu.memory.pipe_outputs == 0  # in device memory
    assert gpu.memory.process_peak == RUNTIME_BYTES + gpu.memory.checkpoint_snapshot
    assert gpu.evaluation["process_total"] == EVAL_RUNTIME_BYTES + gpu.evaluation["weights_file_pages"]
    # Benchmarks: rank 0 also runs the harness.
    bench = plan(make_config(model=m, train={"steps": 10, "checkpoint_every": 5},
                             evaluate={"benchmarks": [{"name": "mc", "tasks": ["arc_easy"]}]}), device="gpu")
    assert bench.evaluation["process_total"] == gpu.evaluation["process_total"] + HARNESS_RUNTIME_BYTES


def test_expert_parallelism_divides_the_experts_states_and_counts_the_all_to_all() -> None:
    """parallel.ep: each rank holds E / ep experts of every routed layer, their ZeRO partitions (and their gradient
    reduction) are cut over the dp / ep ranks holding the same experts (the dense rest over dp), and each routed
    layer's rows cross the expert-parallel group 4 times a micro-batch ((ep - 1) / ep of them leave the rank)."""
    model = {"family": "qwen3_moe", "qk_norm": True, "vocab_size": 256, "seq_len": 64, "n_layers": 2, "d_model": 64,
             "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}
    cfg = make_config(model, {"dp": 4, "zero_stage": 1, "micro_batches": 2}, {"micro_batch_size": 2})
    dense, split = plan(cfg, device="cpu"), plan(cfg.with_overrides({"parallel.ep": 2}), device="cpu")
    experts = 2 * 8 * 3 * 32 * 64  # per layer: 8 experts of gate, up and down, 32 x 64 each
    assert dense.params_total == split.params_total and dense.params_per_rank - split.params_per_rank == experts // 2
    rest = dense.params_per_rank - experts
    assert dense.stages[0]["optimizer_states"] == 12 * -(-dense.params_per_rank // 4)
    assert split.stages[0]["optimizer_states"] == 12 * (-(-rest // 4) + -(-(experts // 2) // 2))
    # ZeRO-1 all-reduces the fp32 gradients (2 (N-1) / N of them leave) and all-gathers the updated shards
    # ((N-1) shards arrive): the dense rest over the 4 dp ranks, each rank's experts over the 2 holding them.
    assert dense.step.dp_ring_bytes == 2 * 3 * dense.params_per_rank * 4 // 4 + 3 * -(-dense.params_per_rank // 4) * 4
    assert split.step.dp_ring_bytes == (2 * 3 * rest * 4 // 4 + 3 * -(-rest // 4) * 4
                                        + 2 * 1 * (experts // 2) * 4 // 2 + 1 * -(-(experts // 2) // 2) * 4)
    assert split.step.dp_grad_payload_bytes == dense.step.dp_grad_payload_bytes - experts // 2 * 4
    at_dp = plan(cfg.with_overrides({"parallel.ep": 4}), device="cpu").step  # one rank holds each expert
    assert at_dp.dp_ring_bytes == 2 * 3 * rest * 4 // 4 + 3 * -(-rest // 4) * 4
    assert dense.step.ep_alltoall_bytes == 0 and dense.step.ep_comm_s == 0
    rows = 2 * 64 * 2 * 2  # micro-batch x seq x k x micro-batches
    assert split.step.ep_alltoall_bytes == 4 * 2 * rows * 64 * 4 // 2  # 2 routed layers, fp32 rows, half leave
    assert split.step.comm_s == pytest.approx(split.step.dp_comm_s + split.step.ep_comm_s)
    assert "EP all-to-all" in render(split)
    assert plan(cfg.with_overrides({"parallel.ep": 4}), device="cpu").layout["ep"] == 4
    for overrides, message in (({"parallel.ep": 3}, r"parallel\.ep \(3\) must divide parallel\.dp \(4\)"),
                               ({"model.num_experts": 6, "parallel.ep": 4},
                                r"parallel\.ep \(4\) must divide model\.num_experts \(6\)"),
                               ({"parallel.ep": 2, "parallel.zero_stage": 0},
                                r"parallel\.ep \(2\) needs parallel\.zero_stage 1 or 2")):
        with pytest.raises(ConfigError, match=message):
            cfg.with_overrides(overrides)
    with pytest.raises(ConfigError, match=r"parallel\.ep \(2\) splits a mixture of experts' experts; model\.family "
                                          r"'gpt' has none"):
        make_config(parallel={"dp": 2}).with_overrides({"parallel.ep": 2})


def test_a_nodes_host_memory_adds_up_the_ranks_placed_on_it() -> None:
    """Ranks are placed node-major in the layout's order (TP innermost, then DP, then PP): with 4 ranks a node,
    tp 2 x dp 2 x pp 2 puts stage 0 whole on node 0 and stage 1 on node 1; with 2 a node, each node holds one
    stage's TP pair; a local job's one node holds every rank."""
    from tasks.plan.host import node_peak_bytes

    layout = Layout(tp=2, pp=2, dp=2)
    assert node_peak_bytes(layout, 4, [10, 7]) == 40
    assert node_peak_bytes(layout, 2, [10, 7]) == 20
    assert node_peak_bytes(layout, 8, [10, 7]) == 4 * 10 + 4 * 7
    assert node_peak_bytes(Layout(tp=1, pp=4, dp=1), 2, [1, 2, 3, 9]) == 12  # node 1: stages 2 and 3


def test_the_plan_holds_a_nodes_ranks_against_its_host_memory() -> None:
    """Every rank of a node snapshots its model states to host memory at a save: the plan adds the node's ranks'
    process peaks (or its evaluation ranks') and refuses a node whose `cluster.host_memory_gib` cannot hold them,
    naming the field; unset, the figure is printed and nothing is refused, but for the local launcher, whose node is
    this machine: its memory is the capacity, named so."""
    from tasks.plan.host import this_machine_memory_bytes
    from tasks.plan.render import gib, shortfall

    cfg = make_config(parallel={"tp": 1, "pp": 2, "dp": 2},
                      cluster={"gpus_per_node": 4, "launcher": "ssh", "hosts": ["gpu-a"]})
    free = plan(cfg, device="gpu")
    training = 2 * sum(s["process_total"] for s in free.stages)  # one node: both stages, two DP ranks each
    assert free.memory.host_node_peak == max(training, 4 * free.evaluation["process_total"])
    assert free.memory.host_capacity is None and free.fits
    assert "host memory per node" in render(free) and "not checked" in render(free)
    roomy = plan(cfg.with_overrides({"cluster.host_memory_gib": free.memory.host_node_peak / 2**30}), device="gpu")
    assert roomy.fits and roomy.memory.host_capacity == free.memory.host_node_peak
    tight = plan(cfg.with_overrides({"cluster.host_memory_gib": free.memory.host_node_peak / 2**30 / 2}),
                 device="gpu")
    assert not tight.fits and tight.overflow is not None and tight.overflow["term"] == "host_memory"
    assert tight.overflow["by_bytes"] == free.memory.host_node_peak - tight.memory.host_capacity
    assert shortfall(tight) == (f"{gib(tight.overflow['by_bytes'])} over cluster.host_memory_gib "
                                f"({gib(tight.memory.host_capacity)}) on a node: its ranks' host memory together "
                                f"{gib(free.memory.host_node_peak)}")
    local = plan(cfg.with_overrides({"cluster.launcher": "local"}), device="gpu")
    assert local.memory.host_capacity == this_machine_memory_bytes() > 0
    assert f"of {gib(this_machine_memory_bytes())} (this machine's memory (the local launcher))" in render(local)


def test_a_local_run_that_this_machine_cannot_hold_is_refused_naming_its_memory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The local launcher's ranks all run here: a plan whose ranks together need more than this machine's memory
    (here its container's limit, a cgroup file holding half what they need) is refused before a rank starts, saying
    so; a container without a limit ("max") leaves the machine's RAM."""
    from tasks.plan import host
    from tasks.plan.render import gib, shortfall

    cfg = make_config(parallel={"tp": 1, "pp": 2, "dp": 2})
    needed = plan(cfg, device="cpu").memory.host_node_peak
    limit = tmp_path / "memory.max"
    limit.write_text(f"{needed // 2}\n")
    monkeypatch.setattr(host, "CGROUP_LIMITS", (tmp_path / "absent", limit))
    refused = plan(cfg, device="cpu")
    assert not refused.fits and refused.overflow is not None and refused.overflow["term"] == "host_memory"
    assert refused.memory.host_capacity == needed // 2
    assert shortfall(refused).startswith(f"{gib(needed - needed // 2)} over this machine's memory (the local "
                                         f"launcher) ({gib(needed // 2)}) on a node")
    limit.write_text("max\n")
    assert plan(cfg, device="cpu").memory.host_capacity == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_recompute_hint_is_given_only_where_recomputation_would_make_it_fit() -> None:
    """A device overflowing by its activations is told that `train.activation_checkpointing` would fit it; a plan
    refused for a node's host memory is not (recomputation frees device memory, not the host's)."""
    cfg = make_config(model={"seq_len": 2048}, train={"micro_batch_size": 8})
    loose = plan(cfg, device="gpu")
    saved = loose.memory.activations - loose.memory.activations_with_recompute
    assert saved > 0
    between = (loose.memory.total - saved / 2) / 2**30  # fits only with recomputation
    tight = plan(cfg.with_overrides({"cluster.gpu_memory_gib": between}), device="gpu")
    assert not tight.fits and "would fit with train.activation_checkpointing: true" in tight.warnings
    host = plan(cfg.with_overrides({"cluster.host_memory_gib": 0.1}), device="gpu")
    assert not host.fits and host.overflow is not None and host.overflow["term"] == "host_memory"
    assert not [w for w in host.warnings if "activation_checkpointing" in w]
