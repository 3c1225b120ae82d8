"""The planner's per-rank process memory against a real training's peak RSS (issues 27, 28, 38).

A small Llama (45M parameters, so the tensors, not the runtime, are most of a rank's memory) trains
24 steps on 2 pipeline ranks (gloo, CPU, fp32, ZeRO-1), saving a checkpoint at every step; each rank's
high-water mark (`ru_maxrss`, reported in the summary) must be within 15% of `retrainer plan`'s prediction
for its stage, and its memory must plateau: the anonymous RSS after the last save within 5% of that after
the second (each rank's `rss_trace` in the summary). The evaluation ranks scoring its checkpoint must peak
within 15% of the plan's evaluation term. The same run as a LoRA adapter on base weights (frozen base,
adapter-only checkpoint, 2 steps) must peak lower on every rank, and within 15% of the planner's LoRA
prediction; so must a mixture of experts at dp=2 x ep=2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.config.schema import JobConfig
from tasks.evaluate import evaluation_launch
from tasks.launch import train
from tasks.plan import Plan, plan
from tasks.runs.identity import RunIdentity
from tests.checkpoints import write_base_weights
from tests.train.conftest import tiny_config, write_dataset

pytestmark = pytest.mark.multiproc

MODEL = {"model.family": "llama", "model.vocab_size": 16384, "model.d_model": 768, "model.n_layers": 4,
         "model.n_heads": 8, "model.n_kv_heads": 4, "model.d_ff": 2048, "model.seq_len": 64}
RUN = {**MODEL, "parallel.pp": 2, "parallel.micro_batches": 2, "train.micro_batch_size": 2, "train.steps": 2,
       "train.checkpoint_every": 2}
SAVES = 24  # the full run saves at every step (issue 38: each save left a rank holding more)
FULL = {**RUN, "train.steps": SAVES, "train.checkpoint_every": 1}
LORA = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _measure(cfg: JobConfig, dataset: Path, **run: Any) -> tuple[Plan, dict[str, Any]]:
    """The plan of `cfg` and the run's summary, whose peak RSS per rank (two ranks) is checked against it."""
    predicted = plan(cfg, device="cpu")
    summary = train(cfg, dataset, **run)
    measured = summary["peak_rss_bytes"]
    assert len(measured) == 2
    for rank, peak in enumerate(measured):
        stage = predicted.stages[cfg.parallel.layout.coord(rank).pp]
        want = stage["process_total"]
        # The starting weights' file pages count in a rank's RSS only while mapped and resident in it: whether
        # they still are at its high-water mark depends on the page cache (a LoRA rank 0 peaked at 565 MiB on one
        # box, 453 MiB on a fresh one, planned 531). The plan must hold within 15% with that term or without it.
        without_pages = want - stage["process"]["weights_file_pages"]
        assert without_pages - 0.15 * peak <= peak <= want + 0.15 * peak, (
            f"{'LoRA' if cfg.train.lora else 'full'} rank {rank}: planned {want / 2**20:.0f} MiB "
            f"({stage['process']}), measured peak RSS {peak / 2**20:.0f} MiB")
    assert predicted.memory.process_peak == max(s["process_total"] for s in predicted.stages)
    return predicted, summary


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "dataset")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, dataset: Path) -> tuple[JobConfig, Plan, dict[str, Any]]:
    """The full fine-tuning run, measured once for the tests below."""
    cfg = tiny_config(tmp_path_factory.mktemp("full"), {**FULL, "data.source_url": str(dataset)})  # evaluated too
    return cfg, *_measure(cfg, dataset)


def test_planned_process_memory_matches_each_ranks_peak_rss(full_run: tuple[JobConfig, Plan, dict[str, Any]]) -> None:
    _, predicted, _ = full_run
    assert predicted.params_total > 40_000_000
    for stage in predicted.stages:
        assert stage["process"]["runtime"] < 0.4 * stage["process_total"], \
            "the tensors must matter, not only the runtime constant"


def test_a_ranks_memory_plateaus_across_saves(full_run: tuple[JobConfig, Plan, dict[str, Any]]) -> None:
    """Every step saves: what a rank holds after the last save is what it held after the second."""
    _, _, summary = full_run
    assert len(summary["checkpoint_saves"]) == SAVES
    for rank, trace in enumerate(summary["rss_trace"]):
        assert [step for step, _, _ in trace] == list(range(1, SAVES + 1))
        anon = {step: anon_bytes for step, _, anon_bytes in trace}
        assert anon[SAVES] <= 1.05 * anon[2], (
            f"rank {rank}: anonymous RSS {anon[2] / 2**20:.0f} MiB after the 2nd save, {anon[SAVES] / 2**20:.0f} MiB "
            f"after the {SAVES}th: {[round(a / 2**20) for a in anon.values()]}")


def test_the_evaluation_ranks_peak_as_planned(full_run: tuple[JobConfig, Plan, dict[str, Any]], dataset: Path) -> None:
    """The run's checkpoint scored by its evaluation ranks (its layout, in bf16, `evaluate.dtype`'s default): each
    rank's peak RSS within 15% of the plan's evaluation term for the busiest stage."""
    cfg, predicted, summary = full_run
    launch, _ = evaluation_launch(cfg, RunIdentity.from_dict(summary["run"]), summary["checkpoint_dir"], dataset,
                                  Path(cfg.train.output_dir))  # the `train` verb's run directory
    peaks = launch.run_here()["peak_rss_bytes"]
    assert predicted.evaluation is not None and len(peaks) == 2
    ev = predicted.evaluation
    want = ev["process_total"]
    # Never under the tensors it holds, never over the plan. Not bounded below by the plan: whether the checkpoint's
    # pages are still resident at the high-water mark depends on the page cache (measured 423 MiB in one suite,
    # under 400 alone; planned 343 without them), and a rank forked from its spawner (tasks/base/spawn.py) counts
    # only the library pages it touches itself (288 MiB measured once against 343 planned without the pages).
    for rank, peak in enumerate(peaks):
        assert ev["total"] <= peak <= want + 0.15 * peak, (
            f"evaluation rank {rank}: planned {want / 2**20:.0f} MiB ({predicted.evaluation}), measured peak RSS "
            f"{peak / 2**20:.0f} MiB")


def test_a_lora_run_peaks_lower_than_the_full_run_and_as_planned(
        tmp_path: Path, dataset: Path, full_run: tuple[JobConfig, Plan, dict[str, Any]]) -> None:
    """LoRA on base weights (model.pretrained names them): the base has no gradients or optimizer states and
    the save snapshots only the adapters."""
    cfg = tiny_config(tmp_path, {**RUN, "model.pretrained": str(tmp_path / "base"), "train.lora": LORA})
    base = write_base_weights(cfg.model, tmp_path / "base")
    assert cfg.lora_saves_adapters_only
    lora_peaks = _measure(cfg, dataset, init_path=base)[1]["peak_rss_bytes"]
    full_peaks = full_run[2]["peak_rss_bytes"]
    for rank, (lora, full) in enumerate(zip(lora_peaks, full_peaks, strict=True)):
        assert lora < full, f"rank {rank}: LoRA peak RSS {lora / 2**20:.0f} MiB, full run {full / 2**20:.0f} MiB"


def test_an_expert_parallel_run_peaks_as_planned(tmp_path: Path, dataset: Path) -> None:
    """A mixture of experts (8 experts of each of 4 layers: most of its 70M parameters) at dp=2 x ep=2: each rank
    holds half of every layer's experts and, with ep = dp, all of their optimizer state; both ranks peak within
    15% of the plan, which counts what ep splits and what it does not."""
    moe = {"model.family": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 8, "model.num_experts_per_tok": 2,
           "model.moe_intermediate_size": 512, "model.router_aux_loss_coef": 0.001}
    cfg = tiny_config(tmp_path, {**RUN, **moe, "parallel.pp": 1, "parallel.dp": 2, "parallel.ep": 2,
                                 "parallel.micro_batches": 1, "data.source_url": str(dataset)})
    predicted, summary = _measure(cfg, dataset)
    assert summary["layout"]["ep"] == 2
    assert predicted.params_total > 60_000_000 and predicted.params_per_rank < 0.75 * predicted.params_total
