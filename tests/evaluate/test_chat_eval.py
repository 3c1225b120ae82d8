"""A chat model's evaluation: held-out conversations scored on the assistant's tokens only, packed as trained (each
conversation attends only within itself) and across pipeline stages: the loss is transformers' loss, conversation
by conversation with labels -100 outside the assistant spans, over every assistant token of the scored windows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tasks.evaluate import evaluate
from tasks.evaluate.spec import window_order
from tasks.models import get_family
from tasks.runs.identity import for_dataset
from tasks.train.data import TokenWindows
from tests.chat import LLAMA3
from tests.checkpoints import commit_reference
from tests.train.conftest import tiny_config
from tests.train.test_packed import MODEL, SEQ, chat_dataset, conversations_in, documents, hf_loss

SEED = 3


@pytest.mark.multiproc
def test_held_out_conversations_are_scored_on_the_assistant_tokens_across_stages(tmp_path: Path) -> None:
    source = chat_dataset(tmp_path, LLAMA3, 48, seed=9, heldout_fraction=0.5)
    cfg = tiny_config(tmp_path, {"model.family": "llama", **{f"model.{k}": v for k, v in MODEL.items()},
                                 "data.source_url": str(source), "evaluate.dtype": "fp32",
                                 "publish.export_dtype": "fp32",  # scored as published: unrounded here
                                 "evaluate.batches": 2, "evaluate.batch_size": 3,
                                 "evaluate.parallel": {"tp": 1, "pp": 2, "dp": 1}})
    run = for_dataset(cfg, str(source))
    ckpt = commit_reference(cfg, run, get_family("llama").Reference(cfg.model, SEED).state_dict(), cfg.train.steps)
    scored = evaluate(cfg, run, ckpt, str(source)).metrics

    windows = TokenWindows(source, "heldout", SEQ, cfg.model.vocab_size)
    order = window_order(len(windows), cfg.evaluate.batches, cfg.evaluate.batch_size)
    assert len(set(order.tolist())) == len(order)  # each window once: the expected loss counts it once
    convs = conversations_in(windows, order.tolist())
    assert sum(len(documents(windows, w)) > 1 for w in order.tolist()) >= 2  # windows packing several
    want, assistant_tokens = hf_loss(cfg.model, SEED, convs)
    assert scored["heldout.tokens"] == assistant_tokens
    assert scored["heldout.loss"] == pytest.approx(want, rel=1e-5), (scored["heldout.loss"], want)
    assert math.isclose(scored["heldout.perplexity"], math.exp(scored["heldout.loss"]))
