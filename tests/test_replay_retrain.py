"""Retraining on new data with replay of an earlier snapshot, as a platform team runs it (the real CLI).

Week 1 trains on snapshot A. Week 2 a new snapshot B lands; the config mixes 5% of A back in
(`data.replay`) and the run continues from the live model. The mixture is part of the run's key and
of the published version's lineage; a replay source that is not there fails the run, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.runs.identity import experiment_key
from tests.test_weekly_retrain import new_week, retrainer, run, show, week_config

pytestmark = pytest.mark.multiproc


def with_data(config: Path, **data: object) -> None:
    cfg = yaml.safe_load(config.read_text())
    cfg["data"].update(data)
    config.write_text(yaml.safe_dump(cfg))


def test_week_two_trains_on_new_data_with_replay_and_its_version_names_the_mixture(tmp_path: Path) -> None:
    config = week_config(tmp_path)
    snap_a, snap_b = str(tmp_path / "store" / "snap-a"), str(tmp_path / "store" / "snap-b")
    assert retrainer("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'registry.db'}", tmp=tmp_path).returncode == 0

    # Week 1: snapshot A alone.
    with_data(config, source_url=snap_a)
    new_week(config, tmp_path, seed=101)
    week1 = run(config, tmp_path)
    assert week1["run"]["replay"] == [] and week1["publish"]["version"] == 1
    hash_a = week1["run"]["data_manifest_hash"]

    # Week 2: snapshot B, with 5% replay of A, from the live model (v1).
    with_data(config, source_url=snap_b, replay=[{"source_url": snap_a, "weight": 0.05}])
    new_week(config, tmp_path, seed=202)
    week2 = run(config, tmp_path)
    mixture = [{"url": snap_a, "manifest_hash": hash_a, "weight": 0.05}]
    r = week2["run"]
    assert r["data_url"] == snap_b and r["data_manifest_hash"] != hash_a and r["replay"] == mixture
    assert r["init"]["version"] == 1 and week2["train"]["outcome"] == "trained"
    # The same config, data and starting weights without replay would be another experiment.
    assert week2["experiment_key"] != experiment_key(r["config_fingerprint"], r["data_manifest_hash"],
                                                     r["init"]["digest"])
    assert [w["manifest_hash"] for w in week2["warm"]["replay"]] == [hash_a]
    assert week2["publish"]["version"] == 2 and week2["publish"]["parent_version"] == 1
    versions = {v["version"]: v for v in show(tmp_path)["versions"]}
    assert versions[2]["data_url"] == snap_b and versions[2]["data_manifest_hash"] == r["data_manifest_hash"]
    assert versions[2]["data_replay"] == mixture
    assert versions[1]["data_replay"] == []

    # A replay source that is not there stops the run before anything trains, naming it.
    missing = str(tmp_path / "store" / "snap-gone")
    with_data(config, replay=[{"source_url": missing, "weight": 0.05}])
    done = retrainer("run", str(config), tmp=tmp_path)
    assert done.returncode != 0
    assert f"{missing}: manifest 'manifest.json' not found" in done.stderr
    assert [v["version"] for v in show(tmp_path)["versions"]] == [1, 2]
