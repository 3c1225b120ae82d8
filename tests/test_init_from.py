"""`train.init_from` when it cannot work: each fails clearly, before any rank starts, and publishes nothing.

(`init_from: live` with no live version starts from scratch and says so: the first run of
tests/test_weekly_retrain.py checks that.) And `retrainer train` starts where `retrainer run` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.registry import Registry, upgrade
from tests.test_weekly_retrain import retrainer, week_config

CASES = {
    "version:7": "train.init_from version:7: model 'tiny-llama' is not in the registry",
    "shape": "starting weights' embed.tok.weight has shape (256, 16), the model config needs (256, 32)",
    "missing": "train.init_from: {path}: no such weights file or directory",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_init_from_that_cannot_work_fails_clearly_and_publishes_nothing(tmp_path, case: str) -> None:
    import yaml

    from tasks.models import get_family

    config = week_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    upgrade(cfg["publish"]["registry_url"])
    path = tmp_path / "other-model.pt"
    if case == "version:7":
        cfg["train"]["init_from"] = "version:7"
    elif case == "shape":  # a model of another width: the first mismatched tensor is named
        other = {**cfg["model"], "d_model": 16, "d_ff": 32}
        from tasks.config.model import ModelConfig

        m = ModelConfig(**other)
        torch.save(get_family(m.family).Reference(m).state_dict(), path)
        cfg["train"]["init_from"] = str(path)
    else:
        cfg["train"]["init_from"] = str(path)
    config.write_text(yaml.safe_dump(cfg))
    assert retrainer("make-data", str(config), "--tokens-per-shard", "16384", tmp=tmp_path).returncode == 0

    done = retrainer("run", str(config), tmp=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("retrainer: error:")]
    assert error and CASES[case].format(path=path) in error[0], done.stderr[-2000:]
    assert "launching" not in done.stderr  # no rank was started
    registry = Registry(cfg["publish"]["registry_url"])
    assert registry.models() == []


@pytest.mark.multiproc
def test_train_verb_starts_from_the_weights_init_from_names_as_run_does(tmp_path: Path) -> None:
    """`retrainer train` resolves `train.init_from` as `retrainer run` does: the ranks load the pretrained weights
    (its first loss is `run`'s, not a scratch run's), and a corrupt folder no longer "passes" `train`."""
    import json

    import yaml

    from tests.models.test_pretrained_intake import TENSOR, job, make_hf_llama, refused, rewrite

    hf = make_hf_llama(tmp_path / "hf", vocab=256, hidden=32, layers=2, heads=2, kv_heads=2, ffn=64, shard="40KB")
    config = job(tmp_path, hf)
    assert retrainer("make-data", str(config), "--tokens-per-shard", "16384", tmp=tmp_path).returncode == 0

    def first_loss(*args: str) -> tuple[float, dict, str]:
        done = retrainer(*args, "--steps", "1", "--json", tmp=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout)
        return (out["first_loss"] if args[0] == "train" else out["train"]["first_loss"]), out, done.stderr

    trained, summary, said = first_loss("train", str(config))
    assert summary["started_from"].startswith(f"pretrained {hf} (listing ")
    assert f"starting weights: pretrained {hf}" in said and "tensors per rank from" in said  # the ranks loaded it
    ran, _, _ = first_loss("run", str(config))
    assert trained == ran

    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(init_from="scratch", output_dir=str(tmp_path / "scratch"))
    config.write_text(yaml.safe_dump(cfg))
    scratch, summary, _ = first_loss("train", str(config))
    assert summary["started_from"].startswith("scratch") and scratch != trained

    cfg["train"].update(init_from="pretrained", output_dir=str(tmp_path / "nan"))
    config.write_text(yaml.safe_dump(cfg))
    shard = rewrite(hf, TENSOR, lambda t: t.fill_(float("nan")))
    done = retrainer("train", str(config), tmp=tmp_path)
    refused(done, f"{shard.name}: tensor {TENSOR} holds NaN at flat index 0;")
    assert "launching" not in done.stderr and not (tmp_path / "nan").exists()
