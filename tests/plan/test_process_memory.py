"""The planner's per-rank process memory against a real training's peak RSS (issue 27).

A small Llama (45M parameters, so the tensors, not the runtime, are most of a rank's memory) trains
2 steps on 2 pipeline ranks (gloo, CPU, fp32, ZeRO-1) and saves a checkpoint; each rank's high-water
mark (`ru_maxrss`, reported in the summary) must be within 15% of `retrainer plan`'s prediction for
its stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch import train
from tasks.plan import plan
from tests.train.conftest import tiny_config, write_dataset

pytestmark = pytest.mark.multiproc

MODEL = {"model.family": "llama", "model.vocab_size": 16384, "model.d_model": 768, "model.n_layers": 4,
         "model.n_heads": 8, "model.n_kv_heads": 4, "model.d_ff": 2048, "model.seq_len": 64}


def test_planned_process_memory_matches_each_ranks_peak_rss(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {**MODEL, "parallel.pp": 2, "parallel.micro_batches": 2, "train.micro_batch_size": 2,
                       "train.steps": 2, "train.checkpoint_every": 2})
    predicted = plan(cfg, device="cpu")
    assert predicted.params_total > 40_000_000
    summary = train(cfg, write_dataset(tmp_path / "dataset"))

    measured = summary["peak_rss_bytes"]
    assert len(measured) == 2
    for rank, peak in enumerate(measured):  # pp=2, dp=1: rank r holds stage r
        stage = predicted.stages[rank]
        want = stage["process_total"]
        assert stage["process"]["runtime"] < 0.4 * want, "the tensors must matter, not only the runtime constant"
        assert abs(want - peak) <= 0.15 * peak, (
            f"rank {rank}: planned {want / 2**20:.0f} MiB ({stage['process']}), measured peak RSS "
            f"{peak / 2**20:.0f} MiB")
    assert predicted.memory.process_peak == max(s["process_total"] for s in predicted.stages)
