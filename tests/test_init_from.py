"""`train.init_from` when it cannot work: each fails clearly, before any rank starts, and publishes nothing.

(`init_from: live` with no live version starts from scratch and says so: the first run of
tests/test_weekly_retrain.py checks that.)
"""

from __future__ import annotations

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
        from tasks.config import ModelConfig

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
