"""Evaluate stage: every suite's metrics of a committed checkpoint, scored by evaluation ranks.

Checkpoints here are committed with the trainer's own protocol (`finalize`) from weights trained by
the single-process reference loop; the evaluation itself runs as ranks through the local launcher.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tasks.base.errors import ConfigError, InvalidInputError
from tasks.config.schema import JobConfig
from tasks.evaluate import evaluate
from tasks.evaluate.spec import resolve_suites, suite_hash, window_order
from tasks.models import get_family
from tasks.models.parallel import TPGroup
from tasks.models.weights import load_reference
from tasks.runs.identity import RunIdentity, StartingWeights
from tasks.train.data import TokenWindows
from tests.checkpoints import reference_checkpoint
from tests.evaluate.test_benchmarks import task_folder
from tests.train.conftest import tiny_config

USER_METRIC = {"entry_point": "tests.evaluate.user_metrics:token_prob", "suite": "heldout", "names": ["token_prob"]}
TOKENIZER_METRIC = {"entry_point": "tests.evaluate.user_metrics:vocab_size", "suite": "heldout",
                    "names": ["tokenizer_vocab"]}


def model_files(directory: Path) -> tuple[StartingWeights, int]:
    """A starting model directory with a tokenizer (a BPE trained here) that user metrics receive."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=60, show_progress=False, special_tokens=["<eos>"]))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))  # benchmarks need EOS
    return StartingWeights(requested=str(directory), digest="e" * 64, url=str(directory), kind="tree",
                           note="a local model directory"), tok.get_vocab_size()


@pytest.fixture
def trained(tmp_path: Path) -> tuple[JobConfig, RunIdentity, Path, int]:
    """A tiny llama (the demo's family: vocab-parallel embedding and head) of 3 layers (pp=3 has a middle stage)
    trained 30 steps."""
    cfg = tiny_config(tmp_path, {"model.family": "llama", "model.n_layers": 3, "train.steps": 30,
                                 "evaluate.metrics": [USER_METRIC, TOKENIZER_METRIC]})
    init, vocab = model_files(tmp_path / "base-model")
    run, ckpt = reference_checkpoint(cfg, init)
    return cfg, run, ckpt, vocab


def single_process_loss(cfg: JobConfig, ckpt: Path, dtype: torch.dtype = torch.float32) -> float:
    """The held-out loss of the same windows by one process holding the whole (tiny) model in `dtype`: the
    reference."""
    model = load_reference(ckpt, cfg.model, as_dtype=cfg.publish.export_dtype).to(dtype).eval()
    loss_fn = get_family(cfg.model.family).make_loss_fn(TPGroup())
    windows = TokenWindows(cfg.data.source_url, "heldout", cfg.model.seq_len, cfg.model.vocab_size)
    e = cfg.evaluate
    order = window_order(len(windows), e.batches, e.batch_size)
    with torch.no_grad():
        batch = windows.get(order)
        return float(loss_fn(model(batch[:, :-1]), batch[:, 1:]))


def test_every_layout_gives_the_same_numbers(trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp32 (`evaluate.dtype`), any layout scores what one process holding the whole model scores, and the
    benchmarks (a rolling perplexity; greedy generation, its text scored by chrF) agree across layouts; pp=3 has a
    stage that receives and sends at once (its next window's activations while its last one's are in flight)."""
    cfg, run, ckpt, vocab = trained
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    tasks = str(task_folder(tmp_path / "tasks"))
    cfg = cfg.with_overrides({"evaluate.dtype": "fp32"})
    benchmarks = [{"name": "ppl", "tasks": ["english_ppl"], "include_path": tasks, "metrics": ["word_perplexity"]},
                  {"name": "gen", "tasks": ["english_next"], "include_path": tasks, "metrics": ["chrf"]}]
    results = {}
    for tp, pp, dp in ((1, 1, 1), (1, 1, 2), (2, 2, 1), (1, 3, 1)):
        layout = cfg.with_overrides({"evaluate.parallel": {"tp": tp, "pp": pp, "dp": dp},
                                     # dp=2's share of the requests: tests/evaluate/test_benchmarks.py
                                     "evaluate.benchmarks": benchmarks if dp == 1 else []})
        results[(tp, pp, dp)] = evaluate(layout, run, ckpt, cfg.data.source_url)
    reference = single_process_loss(cfg, ckpt)
    e = cfg.evaluate
    for layout, out in results.items():
        m = out.metrics
        assert m["heldout.loss"] == pytest.approx(reference, rel=1e-6, abs=0), layout
        assert m["heldout.loss"] == out.loss and math.isclose(out.perplexity, math.exp(out.loss))
        assert m["heldout.tokens"] == out.tokens == e.batches * e.batch_size * cfg.model.seq_len
        assert 0 < m["heldout.token_prob"] < 1  # the user metric ran and was recorded
        assert m["heldout.tokenizer_vocab"] == vocab  # the starting model's tokenizer reached it
        assert m["heldout.token_prob"] == pytest.approx(results[(1, 1, 1)].metrics["heldout.token_prob"],
                                                        rel=1e-6), layout
        assert out.checkpoint_tag == "step-000030" and out.step == 30 and out.live is None
        assert out.experiment_key == run.experiment_key
    assert len({results[k].suite_hash for k in ((1, 1, 1), (2, 2, 1))}) == 1  # the layout is not part of it
    one = results[(1, 1, 1)].metrics
    for split in ((2, 2, 1), (1, 3, 1)):  # the benchmarks on 1 rank and on tp x pp, on 3 stages
        got = results[split].metrics
        assert got["ppl.english_ppl.word_perplexity"] == pytest.approx(one["ppl.english_ppl.word_perplexity"],
                                                                       rel=1e-6), split
        assert got["gen.english_next.chrf"] == one["gen.english_next.chrf"] > 0, split  # the same greedy text


def test_refuses_incomplete_foreign_and_unknown(trained, tmp_path: Path) -> None:
    cfg, run, ckpt, _ = trained
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    for layer in ckpt.glob("layer_*"):
        (incomplete / layer.name).write_bytes(layer.read_bytes())
    with pytest.raises(InvalidInputError, match="no COMPLETE marker"):
        evaluate(cfg, run, incomplete, cfg.data.source_url)
    with pytest.raises(InvalidInputError, match="checkpoint from another model"):
        evaluate(cfg.with_overrides({"train.lr": 1e-4}), run, ckpt, cfg.data.source_url)
    # Rules and metrics are checked when the config is loaded, naming the field and the unknown name.
    with pytest.raises(ConfigError, match=r"evaluate.gate.rules\[1\].metric: unknown metric 'frozen.loss'"):
        cfg.with_overrides({"evaluate.gate": {"rules": [{"metric": "heldout.loss"}, {"metric": "frozen.loss"}]}})
    with pytest.raises(ConfigError, match=r"evaluate.metrics\[0\].suite: unknown suite 'general'"):
        cfg.with_overrides({"evaluate.metrics": [{**USER_METRIC, "suite": "general"}]})
    with pytest.raises(ConfigError, match="needs a threshold"):
        cfg.with_overrides({"evaluate.gate": {"rules": [{"metric": "heldout.loss", "against": "absolute"}]}})
    with pytest.raises(ConfigError, match=r"evaluate.parallel.tp \(3\)"):
        cfg.with_overrides({"evaluate.parallel": {"tp": 3}})


def test_cli_prints_json_writes_output_and_exits_2_on_bad_checkpoint(trained, tmp_path: Path) -> None:
    cfg, run, ckpt, _ = trained
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    output = tmp_path / "metrics.json"
    cli = [sys.executable, "-m", "tasks.cli", "evaluate", str(config_path), "--dataset-dir", cfg.data.source_url]
    done = subprocess.run([*cli, "--checkpoint", str(ckpt), "--output", str(output)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    assert printed == json.loads(output.read_text())
    # The default evaluates in bf16, as the model is published and served: one bf16 process's numbers, near fp32's.
    assert cfg.evaluate.dtype == "bf16"
    loss = printed["metrics"]["heldout.loss"]
    assert loss == pytest.approx(single_process_loss(cfg, ckpt, torch.bfloat16), rel=2e-3)
    assert loss == pytest.approx(single_process_loss(cfg, ckpt), rel=2e-2)
    assert loss != single_process_loss(cfg, ckpt)  # bf16 did the arithmetic, not fp32
    suites = resolve_suites(cfg, run)  # a live version's cached numbers are per dtype
    assert suite_hash(cfg, suites) != suite_hash(cfg.with_overrides({"evaluate.dtype": "fp32"}), suites)

    bad = subprocess.run([*cli, "--checkpoint", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "no COMPLETE marker" in bad.stderr and str(tmp_path) in bad.stderr


def test_an_evaluation_ranks_exception_reaches_the_cli_error_line(trained, tmp_path: Path) -> None:
    """`retrainer evaluate` on two ranks whose second one dies of an IndexError (a token id past the
    vocabulary reaches its embedding, tests/hooks): the one error line names the rank, the exception, its
    message and the line of our code, never a bare exit status."""
    import os
    import re

    from tests.launch.helpers import source_line

    cfg, _, ckpt, _ = trained
    config_path = tmp_path / "job.yaml"
    two_ranks = cfg.with_overrides({"evaluate.parallel": {"tp": 1, "pp": 1, "dp": 2}})
    config_path.write_text(yaml.safe_dump(two_ranks.model_dump(mode="json")))
    done = subprocess.run([sys.executable, "-m", "tests.hooks.cli", "evaluate", str(config_path), "--dataset-dir",
                           cfg.data.source_url, "--checkpoint", str(ckpt)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOOK_EVAL_BAD_TOKEN_RANK": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    where = source_line("tasks/models/parallel.py", "return F.embedding(ids, self.weight)")
    error = done.stderr.splitlines()[-1]
    assert re.fullmatch(r"retrainer: error: evaluation of tiny-test failed \(local launcher\): rank 1 failed: "
                        rf"IndexError: index out of range in self \({re.escape(where)} on \S+\)", error), error
    assert "exit status" not in done.stderr and done.stdout == ""
