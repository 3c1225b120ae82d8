"""The planner's per-rank process memory against a real training's peak RSS (issues 27, 28).

A small Llama (45M parameters, so the tensors, not the runtime, are most of a rank's memory) trains
2 steps on 2 pipeline ranks (gloo, CPU, fp32, ZeRO-1) and saves a checkpoint; each rank's high-water
mark (`ru_maxrss`, reported in the summary) must be within 15% of `retrainer plan`'s prediction for
its stage. The same run as a LoRA adapter on base weights (frozen base, adapter-only checkpoint) must
peak lower on every rank, and within 15% of the planner's LoRA prediction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.config import JobConfig
from tasks.launch import train
from tasks.plan import Plan, plan
from tests.checkpoints import write_base_weights
from tests.train.conftest import tiny_config, write_dataset

pytestmark = pytest.mark.multiproc

MODEL = {"model.family": "llama", "model.vocab_size": 16384, "model.d_model": 768, "model.n_layers": 4,
         "model.n_heads": 8, "model.n_kv_heads": 4, "model.d_ff": 2048, "model.seq_len": 64}
RUN = {**MODEL, "parallel.pp": 2, "parallel.micro_batches": 2, "train.micro_batch_size": 2, "train.steps": 2,
       "train.checkpoint_every": 2}
LORA = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _measure(cfg: JobConfig, dataset: Path, **run: Any) -> tuple[Plan, list[int]]:
    """The plan of `cfg` and each rank's measured peak RSS (pp=2, dp=1: rank r holds stage r)."""
    predicted = plan(cfg, device="cpu")
    measured = train(cfg, dataset, **run)["peak_rss_bytes"]
    assert len(measured) == 2
    for rank, peak in enumerate(measured):
        stage = predicted.stages[rank]
        want = stage["process_total"]
        # The starting weights' file pages count in a rank's RSS only while mapped and resident in it: whether
        # they still are at its high-water mark depends on the page cache (a LoRA rank 0 peaked at 565 MiB on one
        # box, 453 MiB on a fresh one, planned 531). The plan must hold within 15% with that term or without it.
        without_pages = want - stage["process"]["weights_file_pages"]
        assert without_pages - 0.15 * peak <= peak <= want + 0.15 * peak, (
            f"{'LoRA' if cfg.train.lora else 'full'} rank {rank}: planned {want / 2**20:.0f} MiB "
            f"({stage['process']}), measured peak RSS {peak / 2**20:.0f} MiB")
    assert predicted.memory.process_peak == max(s["process_total"] for s in predicted.stages)
    return predicted, measured


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "dataset")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, dataset: Path) -> tuple[Plan, list[int]]:
    """The full fine-tuning run, measured once for both tests."""
    return _measure(tiny_config(tmp_path_factory.mktemp("full"), RUN), dataset)


def test_planned_process_memory_matches_each_ranks_peak_rss(full_run: tuple[Plan, list[int]]) -> None:
    predicted, _ = full_run
    assert predicted.params_total > 40_000_000
    for stage in predicted.stages:
        assert stage["process"]["runtime"] < 0.4 * stage["process_total"], \
            "the tensors must matter, not only the runtime constant"


def test_a_lora_run_peaks_lower_than_the_full_run_and_as_planned(tmp_path: Path, dataset: Path,
                                                                 full_run: tuple[Plan, list[int]]) -> None:
    """LoRA on base weights (model.pretrained names them): the base has no gradients or optimizer states and
    the save snapshots only the adapters."""
    cfg = tiny_config(tmp_path, {**RUN, "model.pretrained": str(tmp_path / "base"), "train.lora": LORA})
    base = write_base_weights(cfg.model, tmp_path / "base")
    assert cfg.lora_saves_adapters_only
    _, lora_peaks = _measure(cfg, dataset, init_path=base)
    _, full_peaks = full_run
    for rank, (lora, full) in enumerate(zip(lora_peaks, full_peaks, strict=True)):
        assert lora < full, f"rank {rank}: LoRA peak RSS {lora / 2**20:.0f} MiB, full run {full / 2**20:.0f} MiB"
