"""The forgetting guard as a platform team meets it: week 2's data is of another kind, the candidate is
better on it but has forgotten week 1's distribution (the frozen suite), and the gate refuses it by name.

Same config both weeks (`init_from: live`, suites `new` = the run's own held-out split and `frozen` = week
1's snapshot, a user metric on the frozen suite, two rules), real ranks for training and evaluation.
A retry of week 2's evaluate finds the live model's numbers in the cache instead of scoring it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.data.synthetic import make_data
from tasks.models.resolve import load_config
from tasks.registry import Registry
from tasks.stages.lifecycle import Trained, Warmed, run_lifecycle, stage_evaluate, stage_identify
from tests.services import free_port

ROOT = REPO_ROOT
pytestmark = pytest.mark.multiproc

ENGLISH = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 40)
DIGITS = ("0712 3349 5561 8820 1934 6677 2048 9090 4411 7365 " * 60)


def config(tmp: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"].update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, seq_len=32)
    cfg["parallel"].update(dp=1)
    cfg["train"].update(steps=30, checkpoint_every=30, micro_batch_size=8, warmup_steps=2, lr=1e-2,
                        output_dir=str(tmp / "runs"))
    cfg["data"].update(source_url=str(tmp / "store" / "week"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"] = {
        "batches": 2, "batch_size": 8,
        "suites": [{"name": "new"}, {"name": "frozen", "source_url": str(tmp / "store" / "week1")}],
        "metrics": [{"entry_point": "tests.evaluate.user_metrics:token_prob", "suite": "frozen",
                     "names": ["token_prob"]}],
        "gate": {"rules": [{"metric": "new.loss", "tolerance": 0.0},
                           {"metric": "frozen.loss", "tolerance": 0.05}]},
    }
    cfg["publish"].update(registry_url=f"sqlite:///{tmp / 'registry.db'}", store_url=str(tmp / "store" / "models"))
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snapshot(url: str, text: str, tmp: Path, name: str) -> None:
    corpus = tmp / f"{name}.txt"
    corpus.write_text(text)
    make_data(url, name="tiny-llama", n_train_shards=2, tokens_per_shard=8192, text_files=[str(corpus)])


def test_candidate_that_forgot_the_frozen_suite_is_refused_and_live_numbers_are_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    from tasks.registry import upgrade

    path = config(tmp_path)
    cfg = load_config(path)
    upgrade(cfg.publish.registry_url)
    week1, week = str(tmp_path / "store" / "week1"), cfg.data.source_url
    snapshot(week1, ENGLISH, tmp_path, "english")
    snapshot(week, ENGLISH, tmp_path, "english")  # week 1 trains on the frozen suite's data

    first = run_lifecycle(cfg)
    assert first["train"]["trained_steps"] == 30 and first["publish"]["version"] == 1
    v1 = Registry(cfg.publish.registry_url).get_version("tiny-llama", 1)
    assert [r["metric"] for r in v1.metrics["gate"]] == ["new.loss", "frozen.loss"]  # recorded with the version
    assert v1.metrics["metrics"]["frozen.token_prob"] > 0  # the user metric, recorded

    snapshot(week, DIGITS, tmp_path, "digits")  # week 2: new data of another kind, same URL
    second = run_lifecycle(load_config(path))
    assert second["run"]["init"]["version"] == 1 and second["train"]["trained_steps"] == 30  # trained, from v1
    ev, gate = second["evaluate"], second["gate"]
    assert ev["live"]["version"] == 1 and ev["live"]["cached"] is False  # scored in the same job
    assert ev["metrics"]["new.loss"] < ev["live"]["metrics"]["new.loss"]  # better on the new data
    assert ev["metrics"]["frozen.loss"] > 1.05 * ev["live"]["metrics"]["frozen.loss"]  # forgot week 1
    assert not gate["publish"] and "publish" not in second
    assert "evaluate.gate.rules[1] (frozen.loss min vs live, tolerance 0.05 relative)" in gate["reason"]
    assert "rules[0]" not in gate["reason"]
    assert [r["passed"] for r in gate["rules"]] == [True, False]
    registry = Registry(cfg.publish.registry_url)
    assert registry.live_version("tiny-llama", "production").version == 1  # what is live: still v1

    # An Airflow retry of week 2's evaluate: the live model's numbers on these suites come from the cache.
    cfg2 = load_config(path)
    run = stage_identify(cfg2)
    again = stage_evaluate(cfg2, run, Trained.from_xcom(second["train"]), Warmed.from_xcom(second["warm"]))
    assert again.live.cached is True and again.live.metrics == ev["live"]["metrics"]
    assert again.metrics == pytest.approx(ev["metrics"], rel=1e-9)
