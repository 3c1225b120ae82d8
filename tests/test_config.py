"""Job config: validation at the edge, variable expansion, the experiment key, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "tiny-gpt.yaml"


def write(tmp_path: Path, mutate) -> Path:
    cfg = yaml.safe_load(DEMO.read_text())
    mutate(cfg)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_demo_config_is_valid_and_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    cfg = load_config(DEMO)
    assert cfg.publish.registry_url == f"sqlite:///{tmp_path}/registry.db"
    assert cfg.data.cache_dir == f"{tmp_path}/cache"
    assert cfg.parallel.world_size == 2


def test_env_default_syntax_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRAINER_DB_URL", "postgresql+psycopg://u@db/registry")
    assert load_config(DEMO).publish.registry_url == "postgresql+psycopg://u@db/registry"


def test_experiment_key_ignores_run_time_knobs(tmp_path: Path) -> None:
    base = load_config(DEMO)
    moved = base.with_overrides({"cluster.master_port": 31000, "publish.alias": "staging",
                                 "train.output_dir": str(tmp_path)})
    assert moved.experiment_key() == base.experiment_key()
    assert base.with_overrides({"train.steps": 41}).experiment_key() != base.experiment_key()
    assert len(base.experiment_key()) == 64


def test_overrides_are_validated() -> None:
    base = load_config(DEMO)
    with pytest.raises(ConfigError, match=r"train\.steps"):
        base.with_overrides({"train.steps": 0})
    with pytest.raises(ConfigError, match="unknown field 'stepz'"):
        base.with_overrides({"train.stepz": 3})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["parallel"].update(tp=3), r"parallel\.tp \(3\) must divide model\.n_heads"),
        (lambda c: c["parallel"].update(pp=9), r"parallel\.pp \(9\) cannot exceed model\.n_layers"),
        (lambda c: c["model"].update(d_model=-64), r"model\.d_model"),
        (lambda c: c["parallel"].update(pp=2, zero_stage=2), "zero_stage must be 0 or 1"),
        (lambda c: c.update(name="bad name; drop"), "name"),
    ],
)
def test_invalid_layouts_name_the_field(tmp_path: Path, mutate, message: str) -> None:
    path = write(tmp_path, mutate)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value)
