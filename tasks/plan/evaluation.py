"""Memory of the evaluation ranks (tasks/evaluate): they must fit too, or a run trains and then cannot be judged.

An evaluation rank holds its pipeline stage's tensor-parallel slice of the weights in `evaluate.dtype` (built
in it: no fp32 copy while loading), no gradients or optimizer states, and the temporaries of one forward
(`windows_per_forward`: a batch on one stage, a window across stages): a layer's hidden states, its attention
and MLP intermediates, across stages the activations in flight between them (`evaluation_p2p_buffers`), and on
the last stage the vocab-parallel logits with their fp32 softmax terms (a bf16 rank's logits are taken to fp32
first).

Its host RSS (`process_total`, checked by tests/plan/test_process_memory.py against the ranks' `peak_rss_bytes`)
adds the process's runtime: on CPU runtime + the larger of those tensors and the load (its weights with the
checkpoint's pages, mapped while it reads them: a bf16 rank read a 45M model's fp32 checkpoint at 423 MiB where
runtime + tensors said 343), on a GPU runtime + its slice's file pages while it loads; then, while a suite is
scored, the index of its split's windows (tasks/base/dataset_format.py `SplitShape.index_bytes`) beside the
tensors. The runtime is an evaluation rank's own, below a training rank's (no engine, no optimizer): a 2-rank
evaluation of a tiny model peaked at 282-287 MiB per rank; the 45M Llama of tests/plan/test_process_memory.py at
393-407 MiB in fp32, where runtime + weights + temporaries say 396 (issue 38: the plan without a runtime term was
1.5x below the measured peaks). With benchmarks, rank 0 also holds the harness (`HARNESS_RUNTIME_BYTES`).
"""

from __future__ import annotations

from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig
from tasks.models import get_family
from tasks.models.shapes import EVALUATION_PARTITION, evaluation_p2p_buffers, pipeline_stages, windows_per_forward
from tasks.plan.layout import validate_layout
from tasks.plan.packing import packing_bytes
from tasks.plan.serving import DTYPE_BYTES

FP32 = 4
EVAL_RUNTIME_BYTES = 290 * 1024**2
# Rank 0 runs the benchmarks' harness (`evaluate.benchmarks`): lm-eval, the datasets library, the tokenizer and
# the task data on top of its runtime. Measured: rank 0 of tests/evaluate/test_benchmarks.py peaked at 502 MiB
# against its peer's 289-291 with the same stage (dp=2).
HARNESS_RUNTIME_BYTES = 220 * 1024**2


def evaluation_layout(cfg: JobConfig) -> JobConfig:
    """The job as its evaluation ranks run it: `evaluate.parallel` (or the training layout), ZeRO off, each
    rank holding all the experts of its slice (ep 1: a replica scores its own windows, while an expert-parallel
    group's ranks would have to run every forward together).

    A copy, not a revalidation: the config's validation checked `evaluate.parallel` against the model."""
    layout = (cfg.evaluate.parallel or cfg.parallel).layout
    parallel = cfg.parallel.model_copy(update={**layout.record(), "ep": 1, "zero_stage": 1, "micro_batches": 1})
    return cfg.model_copy(update={"parallel": parallel})


def evaluation_budget(cfg: JobConfig, capacity_bytes: int, on_cpu: bool, packed: bool = False,
                      index_bytes: int = 0) -> dict[str, Any]:
    """Bytes on the busiest evaluation rank and its host RSS, and whether they fit `capacity_bytes` (on CPU the
    host's: the RSS must fit it); an evaluation layout the cluster cannot run is refused naming
    `evaluate.parallel`; `index_bytes`: the index of the largest split a suite reads, held while it is scored."""
    eval_cfg = evaluation_layout(cfg)
    if cfg.evaluate.parallel is not None:
        try:
            validate_layout(eval_cfg)
        except InvalidInputError as exc:
            raise InvalidInputError(f"evaluate.parallel: {exc}") from None
    m, p, e = cfg.model, eval_cfg.parallel, cfg.evaluate
    counts = get_family(m.family).param_counts(m, p.layout)
    windows = windows_per_forward(e.batch_size, p.pp)
    tokens = windows * m.seq_len
    width = DTYPE_BYTES[e.dtype]
    best: dict[str, Any] | None = None
    for stage in pipeline_stages(m.n_layers, p.pp, EVALUATION_PARTITION):
        weights = stage.params(counts) * width
        # One block at a time: input, normed input, q/k/v/attention output, MLP gate/up/product (TP slices).
        hidden = tokens * m.d_model * width
        block = hidden * 3 + tokens * width * (m.d_model + 2 * m.kv_heads * m.head_dim) // p.tp \
            + tokens * width * 3 * m.ffn // p.tp
        if packed:  # a chat run's suites score packed windows: their ids and document masks, one forward's
            block += packing_bytes(m.seq_len, windows, 1)
        # The logits, their fp32 copy (none when they are fp32) and the fp32 log-softmax.
        logit_bytes = width + FP32 + (FP32 if width != FP32 else 0)
        logits = tokens * logit_bytes * -(-m.vocab_size // p.tp) if stage.has_head else 0
        p2p = evaluation_p2p_buffers(p.pp) * hidden
        total = weights + block + logits + p2p
        # The checkpoint's pages, read through a memory map, count in the RSS while the stage loads (its weights as
        # a checkpoint holds them: fp32 at most).
        pages = stage.params(counts) * FP32
        if best is None or total > best["total"]:
            best = {"stage": stage.index, "weights": weights, "activations": block, "logits": logits,
                    "comm_buffers": p2p, "total": total, "weights_file_pages": pages}
    assert best is not None
    loading = best["weights"] + best["weights_file_pages"]
    runtime = EVAL_RUNTIME_BYTES + (HARNESS_RUNTIME_BYTES if e.benchmarks else 0)
    # Loaded first, then scored suite by suite, each split's index held while it is.
    scoring = best["total"] + index_bytes if on_cpu else index_bytes
    process = runtime + max(scoring, loading if on_cpu else best["weights_file_pages"])
    return {**best, "dtype": e.dtype, "runtime": runtime, "data_index": index_bytes, "process_total": process,
            "layout": p.layout.record(), "capacity": capacity_bytes,
            "fits": (process if on_cpu else best["total"]) <= capacity_bytes}
