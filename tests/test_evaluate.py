"""Evaluate stage: held-out metrics of a committed checkpoint (through its export); refusals.

Checkpoints here are committed with the trainer's own protocol (`finalize`) from
weights trained by the single-process reference loop, so no ranks are started.
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

from tasks.config import JobConfig
from tasks.errors import InvalidInputError
from tasks.evaluate import evaluate
from tasks.models.weights import open_weights
from tasks.train import checkpoint as ck
from tasks.train.reference import train_reference
from tests.checkpoints import reference_state, write_layer_files
from tests.train.conftest import tiny_config, write_dataset


def commit(cfg: JobConfig, state: dict[str, torch.Tensor], step: int) -> Path:
    root = ck.ckpt_root(cfg.train.output_dir)
    tag = ck.tag_for(step)
    tmp = root / f"tmp-{tag}"
    tmp.mkdir(parents=True)
    write_layer_files(tmp, cfg.model, state)
    run = for_run(cfg)
    return ck.finalize(root, tag, ck.make_marker(cfg, run, tag, step, 1), keep_last=5)


def for_run(cfg: JobConfig):
    from tasks.run import identity, scratch

    return identity(cfg, "d" * 64, scratch(cfg))


@pytest.fixture
def setup(tmp_path: Path) -> tuple[JobConfig, Path, Path, Path]:
    cfg = tiny_config(tmp_path, {"train.steps": 30})
    dataset = write_dataset(tmp_path / "dataset")
    untrained = commit(cfg, reference_state(cfg.model, cfg.train.seed), 1)
    trained = commit(cfg, train_reference(cfg, dataset).model.state_dict(), 30)
    return cfg, dataset, untrained, trained


def test_trained_checkpoint_scores_better_and_metrics_are_consistent(setup) -> None:
    cfg, dataset, untrained, trained = setup
    before, after = evaluate(cfg, untrained, dataset), evaluate(cfg, trained, dataset)
    assert after["loss"] < before["loss"]
    for metrics in (before, after):
        assert math.isclose(metrics["perplexity"], math.exp(metrics["loss"]))
        assert metrics["tokens"] == cfg.evaluate.batches * cfg.evaluate.batch_size * cfg.model.seq_len
        assert metrics["batches"] == cfg.evaluate.batches and metrics["experiment_key"] == for_run(cfg).experiment_key
    assert after["step"] == 30 and after["checkpoint_tag"] == "step-000030"
    assert evaluate(cfg, trained, dataset) == after  # deterministic windows


def test_evaluation_runs_in_eval_mode(setup, tmp_path: Path) -> None:
    cfg, dataset, _, trained = setup
    dropout_cfg = cfg.with_overrides({"model.dropout": 0.5})
    # model.dropout is part of the experiment key, so re-commit the same weights under that experiment
    other_out = dropout_cfg.with_overrides({"train.output_dir": str(tmp_path / "dropout-run")})
    same_weights = commit(other_out, {n: open_weights(trained, cfg.model).read(n) for n in reference_state(cfg.model)},
                          30)
    assert evaluate(other_out, same_weights, dataset)["loss"] == evaluate(cfg, trained, dataset)["loss"]


def test_refuses_incomplete_and_foreign_checkpoints(setup, tmp_path: Path) -> None:
    cfg, dataset, _, trained = setup
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    for layer in trained.glob("layer_*"):
        (incomplete / layer.name).write_bytes(layer.read_bytes())
    with pytest.raises(InvalidInputError, match="no COMPLETE marker"):
        evaluate(cfg, incomplete, dataset)
    other = cfg.with_overrides({"train.lr": 1e-4})
    with pytest.raises(InvalidInputError, match="checkpoint from another model"):
        evaluate(other, trained, dataset)
    no_heldout = tmp_path / "no-heldout"
    no_heldout.mkdir()
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if not f["key"].startswith("heldout/")]
    (no_heldout / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInputError, match="no heldout/ windows"):
        evaluate(cfg, trained, no_heldout)


def test_cli_prints_json_writes_output_and_exits_2_on_bad_checkpoint(setup, tmp_path: Path) -> None:
    cfg, dataset, _, trained = setup
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    output = tmp_path / "metrics.json"
    cli = [sys.executable, "-m", "tasks.cli", "evaluate", str(config_path), "--dataset-dir", str(dataset)]
    done = subprocess.run([*cli, "--checkpoint", str(trained), "--output", str(output)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads(output.read_text()) == evaluate(cfg, trained, dataset)

    bad = subprocess.run([*cli, "--checkpoint", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "no COMPLETE marker" in bad.stderr and str(tmp_path) in bad.stderr
