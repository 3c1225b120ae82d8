"""Warming a training mixture (`data.replay`): every source into one cache, each verified against the
manifest the run was identified with, on this machine (the warm stage) and on a training node."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.config.schema import JobConfig
from tasks.data.cache import DiskBudgetError
from tasks.data.synthetic import make_data
from tasks.data.warm import warm_mixture
from tasks.inputs.node import describe, node_spec, warm_node
from tasks.runs.identity import identity, scratch
from tasks.stages.lifecycle import stage_warm
from tasks.train.data import replay_dataset_dir
from tests.train.conftest import tiny_config


def _snapshots(tmp_path: Path) -> tuple[str, JobConfig]:
    """This week's snapshot B and last week's A, and a job on B with 5% replay of A: (A's URL, job)."""
    new, old = str(tmp_path / "snap-b"), str(tmp_path / "snap-a")
    make_data(new, name="tiny-test", seed=1, n_train_shards=2, tokens_per_shard=4096)
    make_data(old, name="tiny-test", seed=2, n_train_shards=1, tokens_per_shard=4096)
    cfg = tiny_config(tmp_path, {"data.source_url": new, "data.replay": [{"source_url": old, "weight": 0.05}]})
    return old, cfg


def test_stage_warm_warms_every_source_and_refuses_a_replay_snapshot_that_changed(tmp_path: Path) -> None:
    old, cfg = _snapshots(tmp_path)
    primary, replay = warm_mixture(cfg, progress=False)
    run = identity(cfg, primary.manifest_hash, scratch(cfg), [replay.manifest_hash])
    out = stage_warm(cfg, run)
    assert out.dataset_dir == primary.dataset_dir
    assert [(r["url"], r["manifest_hash"]) for r in out.replay] == [(old, replay.manifest_hash)]
    # The ranks find the replay source beside the primary, by the hash the run planned.
    assert replay_dataset_dir(primary.dataset_dir, old, replay.manifest_hash) == replay.dataset_dir
    with pytest.raises(InvalidInputError, match=f"replay source {old}: not warmed at"):
        replay_dataset_dir(primary.dataset_dir, old, "f" * 64)
    with pytest.raises(InvalidInputError, match=f"replay source {old}: the primary dataset .* is not in a warm cache"):
        replay_dataset_dir(cfg.data.source_url, old, replay.manifest_hash)  # a dataset directory no warm put there

    make_data(old, name="tiny-test", seed=3, n_train_shards=1, tokens_per_shard=4096)  # A rewritten after identify
    with pytest.raises(RetrainerError, match=f"{old}: the dataset changed since this run started"):
        stage_warm(cfg, run)


def test_node_warm_verifies_every_source_naming_node_and_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, cfg = _snapshots(tmp_path)
    primary, replay = warm_mixture(cfg, progress=False)
    run = identity(cfg, primary.manifest_hash, scratch(cfg), [replay.manifest_hash])
    monkeypatch.setenv("NODE_NAME", "node-7")
    node_cfg = cfg.with_overrides({"data.cache_dir": str(tmp_path / "node-cache")})  # the node's own disk
    report = warm_node(node_spec(node_cfg, run, run.run_dir(cfg)))
    assert [r["manifest_hash"] for r in report["replay"]] == [replay.manifest_hash]
    assert Path(report["replay"][0]["dataset_dir"]).parent == Path(report["dataset_dir"]).parent
    assert f"replay {replay.manifest_hash[:12]}" in describe(report)

    make_data(old, name="tiny-test", seed=3, n_train_shards=1, tokens_per_shard=4096)
    with pytest.raises(RetrainerError, match=f"node node-7: the dataset at {old} verified as manifest"):
        warm_node(node_spec(node_cfg, run, run.run_dir(cfg)))


def test_a_budget_never_evicts_one_source_of_the_mixture_for_another(tmp_path: Path) -> None:
    _, cfg = _snapshots(tmp_path)
    primary = warm_mixture(cfg.with_overrides({"data.replay": []}), progress=False)[0]
    size = sum(p.stat().st_size for p in primary.dataset_dir.rglob("*") if p.is_file())
    tight = cfg.with_overrides({"data.disk_budget_bytes": size + 1024})  # room for the primary alone
    with pytest.raises(DiskBudgetError, match="in use"):
        warm_mixture(tight, progress=False)
    assert (primary.dataset_dir / "manifest.json").is_file()
