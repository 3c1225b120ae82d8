"""Housekeeping as a platform team meets it: weekly retrains prune their checkpoints once published, and
`retrainer gc` reclaims exactly what no kept version needs, while every registry version still pulls.

The weekly runs are the real lifecycle (`retrainer run`, tests/test_weekly_retrain.py's config); what a
long-running deployment accumulates besides (an aborted export, an aborted publish, a run killed before its
first checkpoint) is left the way those failures leave it, then everything is aged a month.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.base.fsutil import dir_bytes
from tasks.evaluate.cache import write_cached
from tasks.models.resolve import load_config
from tasks.registry import ArtifactStore, Lineage, Registry, upgrade
from tasks.runs.identity import claim_run_dir, identity, scratch
from tasks.stages.lifecycle import describe_outcome
from tasks.train.checkpoint import read_latest
from tests.registry.test_tree import model_dir
from tests.test_weekly_retrain import ROOT, new_week, retrainer, run, week_config

MONTH = 30 * 86400
Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """The real `retrainer` entry point in this process."""
    import tasks.cli

    def call(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = tasks.cli.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return call


def edit(config: Path, **sections: dict[str, Any]) -> None:
    cfg = yaml.safe_load(config.read_text())
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    config.write_text(yaml.safe_dump(cfg))


def age(*roots: Path, spare: Path, seconds: float = MONTH) -> None:
    """Make everything under `roots` look `seconds` old (a month of weekly runs later), but `spare`."""
    then = time.time() - seconds
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                path = Path(dirpath) / name
                if path != spare and spare not in path.parents:
                    os.utime(path, (then, then), follow_symlinks=False)


def listing(*roots: Path) -> set[str]:
    return {str(p) for root in roots for p in root.rglob("*")}


def gc(cli: Cli, config: Path, *flags: str) -> dict[str, Any]:
    rc, out, err = cli("gc", str(config), "--json", *flags)
    assert rc == 0, err[-3000:]
    return json.loads(out)


def kinds(items: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(i["kind"], i["url"]) for i in items}


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[Callable[[str, str], None]]:
    """A training stand-in in its own process that holds an experiment's lock until the test ends."""
    procs: list[subprocess.Popen[bytes]] = []
    work = tmp_path / "holder"
    work.mkdir()

    def hold(registry_url: str, key: str) -> None:
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.airflow.lock_holder", registry_url, key,
                                       str(work), "trainer"], cwd=ROOT))
        (work / "go").touch()
        deadline = time.monotonic() + 60
        while not (work / "trainer.trained").exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, "the lock holder did not take the lock"
            time.sleep(0.05)

    yield hold
    (work / "release").touch()
    for proc in procs:
        proc.wait(timeout=30)


@pytest.mark.multiproc
def test_weekly_runs_prune_on_publish_and_gc_reclaims_exactly_what_no_kept_version_needs(
    tmp_path: Path, cli: Cli, lock_holder: Callable[[str, str], None]
) -> None:
    config = week_config(tmp_path)
    mirror = tmp_path / "mirror"
    # One weekly run's checkpoints mirrored; keep the runs of the live version only, nothing for age's sake.
    edit(config, train={"checkpoint_url": str(mirror)},
         retention={"keep_versions": 1, "keep_runs": 0, "keep_days": 0, "grace_hours": 24})
    cfg = load_config(config)
    db = cfg.publish.registry_url
    assert retrainer("db", "upgrade", "--db", db, tmp=tmp_path).returncode == 0

    # Week 1: trained (checkpoints at steps 4 and 8), published, then pruned to the checkpoint v1 came from.
    new_week(config, tmp_path, seed=101)
    week1 = run(config, tmp_path)
    assert week1["publish"]["version"] == 1
    run1 = Path(week1["train"]["checkpoint_dir"]).parents[1]
    assert kinds(week1["housekeeping"]["pruned"]) == {
        ("checkpoint", str(run1 / "ckpt" / "step-000004")),
        ("checkpoint_mirror", f"file://{mirror}/{run1.name}/step-000004")}
    assert sorted(p.name for p in (run1 / "ckpt").glob("step-*")) == ["step-000008"]
    assert read_latest(run1 / "ckpt") == "step-000008"
    assert sorted(p.name for p in (mirror / run1.name).iterdir()) == ["latest", "step-000008"]
    assert "housekeeping: deleted step-000004 (" in "\n".join(describe_outcome(week1))  # what `retrainer run` prints

    # Week 2 starts from production (v1's registry artifact, not the pruned checkpoints) and becomes v2.
    new_week(config, tmp_path, seed=202)
    week2 = run(config, tmp_path)
    assert week2["run"]["init"]["version"] == 1 and week2["train"]["outcome"] == "trained"
    assert week2["publish"]["version"] == 2 and week2["publish"]["parent_version"] == 1
    run2 = Path(week2["train"]["checkpoint_dir"]).parents[1]
    assert sorted(p.name for p in (run2 / "ckpt").glob("step-*")) == ["step-000008"]
    # An operator rolls production back to v1.
    rc, out, err = cli("rollback", "--model", "tiny-llama", "--db", db, "--reason", "bad answers")
    assert rc == 0 and "version 2 -> version 1" in out, err

    # What else a month of operation leaves: an export whose publish never came (stale staging), a publish
    # that committed its tree and died before the version insert, a run killed before its first checkpoint,
    # evaluation numbers of a version this registry does not have, and an export in flight right now.
    store = ArtifactStore(cfg.publish.store_url)
    stale = store.stage()
    store.stage_file(stale, "model-00001-of-00001.safetensors", model_dir(tmp_path / "w1") / "config.json")
    orphan_tree = store.put_tree(model_dir(tmp_path / "w2"))
    killed = identity(cfg, "f" * 64, scratch(cfg))
    claim_run_dir(Path(cfg.train.output_dir) / killed.run_id, killed)
    write_cached(cfg, 9, "c" * 64, {"heldout.loss": 1.0})
    training = identity(cfg, "e" * 64, scratch(cfg))  # a run training right now: its lock is held
    claim_run_dir(Path(cfg.train.output_dir) / training.run_id, training)
    in_flight = store.stage()
    store.stage_file(in_flight, "model-00001-of-00001.safetensors", tmp_path / "w1" / "config.json")
    runs, models = Path(cfg.train.output_dir), Path(cfg.publish.store_url)
    age(runs, mirror, models, spare=models / "tmp" / in_flight.rsplit("/", 1)[-1])
    lock_holder(db, training.experiment_key)

    unreferenced = {
        ("run_dir", str(run2)),  # v2 is no longer live: its run goes, its artifact stays
        ("run_mirror", f"file://{mirror}/{run2.name}"),
        ("run_dir", str(runs / killed.run_id)),
        ("staging", stale),
        ("tree", orphan_tree.url),
        ("eval_cache", f"file://{models}/eval-cache/tiny-llama/v9/{'c' * 64}.json"),
    }
    before = listing(runs, mirror, models)
    dry = gc(cli, config, "--dry-run")
    assert dry["dry_run"] and kinds(dry["delete"]) == unreferenced
    sizes = {i["url"]: i["bytes"] for i in dry["delete"]}
    assert sizes[str(run2)] == dir_bytes(run2) > 0 and sizes[stale] == dir_bytes(stale.removeprefix("file://")) > 0
    assert dry["bytes"] == sum(sizes.values())
    assert kinds(dry["skipped"]) == {("run_dir", str(runs / training.run_id))}
    assert "already being trained by holder-trainer" in dry["skipped"][0]["reason"]
    kept = {(i["kind"], i["url"]): i["reason"] for i in dry["kept"]}
    assert "tiny-llama v1 (live on production" in kept[("run_dir", str(run1))]
    assert "maybe in flight" in kept[("staging", in_flight)]
    assert listing(runs, mirror, models) == before  # a dry run deletes nothing
    text = cli("gc", str(config), "--dry-run")[1]
    assert "would delete 6 items" in text and "nothing deleted" in text and str(run2) in text

    done = gc(cli, config)
    assert not done["dry_run"] and kinds(done["delete"]) == unreferenced and done["failed"] == []
    assert kinds(done["skipped"]) == {("run_dir", str(runs / training.run_id))}
    gone = [Path(url.removeprefix("file://")) for _, url in unreferenced]
    assert not any(p.exists() for p in gone)
    assert listing(runs, mirror, models) == {p for p in before if not any(p == str(g) or p.startswith(f"{g}/")
                                                                          for g in gone)}
    assert (runs / training.run_id).is_dir() and (run1 / "ckpt" / "step-000008" / "COMPLETE").is_file()

    # Every version still pulls and verifies; the records and the audit trail are as they were.
    with Registry(db) as reg:
        versions = reg.list_versions("tiny-llama")
        assert [(h.action, h.to_version) for h in reg.history("tiny-llama")] == [
            ("publish", 1), ("publish", 2), ("rollback", 1)]
    assert [v.version for v in versions] == [1, 2]
    for v in versions:
        rc, out, err = cli("registry", "pull", "--model", "tiny-llama", "--version", str(v.version), "--db", db,
                           str(tmp_path / "pulled" / f"v{v.version}"))
        assert rc == 0 and "verified" in out, err
        assert store.verify_tree(v.artifact_digest)
    assert gc(cli, config, "--dry-run")["delete"] == []  # nothing left to reclaim while the trainer holds its lock


def test_gc_on_s3_spares_what_is_young_and_what_versions_reference(
    tmp_path: Path, cli: Cli, s3: Any, s3_bucket: str
) -> None:
    from tasks.train.mirror import Mirror

    config = week_config(tmp_path)
    options = s3.storage_options
    models, ckpts = f"s3://{s3_bucket}/models", f"s3://{s3_bucket}/checkpoints"
    edit(config, publish={"store_url": models, "storage_options": options},
         train={"checkpoint_url": ckpts, "checkpoint_storage_options": options},
         retention={"keep_runs": 0, "keep_days": 0, "grace_hours": 1})
    cfg = load_config(config)
    upgrade(cfg.publish.registry_url)
    store = ArtifactStore(models, options)
    live = store.put_tree(model_dir(tmp_path / "live"))
    with Registry(cfg.publish.registry_url) as reg:
        reg.publish_version("tiny-llama", live, Lineage("k" * 64, "data", "rev", "step-000008"), {}, "ci")
        reg.switch_alias("tiny-llama", "production", 1, actor="ci", action="publish")
    orphan = store.put_tree(model_dir(tmp_path / "orphan"))
    staging = store.stage()
    store.stage_file(staging, "model-00001-of-00001.safetensors", tmp_path / "live" / "config.json")
    # A run mirrored from nodes' own disks whose run directory is gone (the node was replaced).
    gone = identity(cfg, "d" * 64, scratch(cfg))
    local = tmp_path / "node-disk" / "step-000004"
    local.mkdir(parents=True)
    (local / "layer_00-model_00-model_states.pt").write_bytes(b"w" * 100)
    (local / "COMPLETE").write_text(json.dumps({"experiment_key": gone.experiment_key}))
    mirror = Mirror(ckpts, options, gone.run_id)
    mirror.upload(local, "step-000004", ["layer_00-model_00-model_states.pt"])
    mirror.commit(local, "step-000004", keep_last=2)

    young = gc(cli, config)  # everything was written just now: all of it might be in flight
    assert young["delete"] == []
    assert {i["kind"] for i in young["kept"]} == {"tree", "staging", "run_mirror"}

    edit(config, retention={"grace_hours": 0})
    done = gc(cli, config)
    assert kinds(done["delete"]) == {("tree", orphan.url), ("staging", staging), ("run_mirror", mirror.url)}
    fresh = s3.filesystem()  # what another process sees (this one's listings are cached)
    assert not fresh.exists(store.tree_path(orphan.digest)) and not fresh.find(mirror.root)
    assert fresh.find(store.tree_path(live.digest))
    rc, out, err = cli("registry", "pull", "--model", "tiny-llama", "--version", "1", "--db",
                       cfg.publish.registry_url, "--storage-options", json.dumps(options), str(tmp_path / "v1"))
    assert rc == 0 and "verified" in out, err

    # Pointed at a registry that knows none of the store's artifacts, gc refuses before deleting anything.
    other = tmp_path / "other.db"
    upgrade(f"sqlite:///{other}")
    edit(config, publish={"registry_url": f"sqlite:///{other}"})
    rc, _, err = cli("gc", str(config))
    assert rc == 1 and "no version in the registry (publish.registry_url) references any of them" in err
    assert store.verify_tree(live.digest)
