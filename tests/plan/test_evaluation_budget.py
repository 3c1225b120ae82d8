"""The evaluation ranks' memory is planned with the training's: a run that could train but not be judged is
refused before anything is held."""

from __future__ import annotations

import pytest

from tasks.base.errors import InvalidInputError
from tasks.models import get_family
from tasks.plan import plan
from tests.plan.conftest import make_config

LLAMA = get_family("llama")

# Llama-3-70B's shape on 8 nodes x 8 GPUs of 80 GiB, trained tp=8 x pp=8.
LLAMA_70B = {"family": "llama", "vocab_size": 128256, "seq_len": 4096, "n_layers": 80, "d_model": 8192,
             "n_heads": 64, "n_kv_heads": 8, "d_ff": 28672, "rope_theta": 500000.0}
CLUSTER = {"launcher": "slurm", "slurm": {"nodes": 8}, "gpus_per_node": 8, "gpu_memory_gib": 80}
TRAIN = {"precision": "bf16", "micro_batch_size": 1, "activation_checkpointing": True}


def seventy_b(evaluate: dict | None = None):
    return make_config(model=LLAMA_70B, parallel={"tp": 8, "pp": 8, "dp": 1, "micro_batches": 16},
                       train=TRAIN, cluster=CLUSTER, evaluate={"batch_size": 1, **(evaluate or {})})


def test_evaluation_in_the_training_layout_fits_and_is_reported() -> None:
    r = plan(seventy_b())
    ev = r.evaluation
    assert r.fits and ev is not None and ev["fits"] and ev["layout"] == {"tp": 8, "pp": 8, "dp": 1}
    assert ev["weights"] < LLAMA.total_params(make_config(model=LLAMA_70B).model) * 2 / 50  # a 64th of it, in bf16
    assert ev["total"] == ev["weights"] + ev["activations"] + ev["logits"] + ev["comm_buffers"]


def test_one_rank_per_replica_cannot_hold_70b_and_the_plan_refuses_naming_evaluation() -> None:
    r = plan(seventy_b({"parallel": {"tp": 1, "pp": 1, "dp": 64}}))
    assert not r.fits and r.verdict == "does_not_fit"
    assert r.overflow is not None and r.overflow["term"] == "evaluation"
    assert r.evaluation is not None
    # All of it, in bf16 (evaluate.dtype's default): 141 GB on an 80 GiB GPU.
    assert r.evaluation["weights"] == LLAMA.total_params(make_config(model=LLAMA_70B).model) * 2


def test_an_evaluation_layout_the_cluster_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match=r"evaluate.parallel: parallel.tp x pp x dp = 32 but "
                                                r"cluster.slurm.nodes \(8\)"):
        plan(seventy_b({"parallel": {"tp": 8, "pp": 2, "dp": 2}}))


@pytest.mark.parametrize(("dtype", "width", "logit_bytes"), [("fp32", 4, 4 + 4), ("bf16", 2, 2 + 4 + 4)])
def test_small_model_by_hand(dtype: str, width: int, logit_bytes: int) -> None:
    """Weights and temporaries in `evaluate.dtype`; the logits with their fp32 copy (bf16) and log-softmax."""
    m = {"vocab_size": 256, "seq_len": 64, "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "d_ff": 256}
    r = plan(make_config(model=m, evaluate={"batch_size": 8, "dtype": dtype}))
    ev = r.evaluation
    tokens = 8 * 64
    assert ev["weights"] == get_family("gpt").total_params(make_config(model=m).model) * width
    assert ev["logits"] == tokens * logit_bytes * 256 and ev["comm_buffers"] == 0
    assert ev["activations"] == (tokens * 64 * width * 3 + tokens * width * (64 + 2 * 4 * 16)
                                 + tokens * width * 3 * 256)
    # Across 2 stages the windows go one at a time (tasks/evaluate/sharded.py): a forward holds one, not 8
    piped = plan(make_config(model=m, parallel={"pp": 2}, evaluate={"batch_size": 8, "dtype": dtype})).evaluation
    one = 64
    assert piped["activations"] == one * 64 * width * 3 + one * width * (64 + 2 * 4 * 16) + one * width * 3 * 256
    assert piped["logits"] == (one * logit_bytes * 256 if piped["stage"] == 1 else 0)
    # Between the stages: the window it computes from, the next one's posted receive, two sends in flight.
    assert piped["comm_buffers"] == 4 * one * 64 * width
