"""Bad input turned away at the door (the rows tests/test_bad_input.py does not cover): an empty
dataset, a manifest whose checksum does not match, a checkpoint from another model, a model name with
SQL metacharacters. Each: a clear error naming the culprit, a non-zero exit, nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.faults.conftest import Trained, driver, make_job, metrics_file, run_task


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def empty_dataset_job(tmp_path: Path):
    job = make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    manifest = tmp_path / "store" / "data" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"] = []
    manifest.write_text(json.dumps(data))
    return job


def test_empty_dataset_is_refused_at_the_door(tmp_path: Path) -> None:
    job = empty_dataset_job(tmp_path)
    rc, out = run_task(driver(job, tmp_path / "state", "warm", "train"), tmp_path / "warm.log")
    assert rc == 2, out[-3000:]
    error = out.split("retrainer: error:")[-1]
    assert "manifest.json" in error and "no train/ files" in error, error
    assert not (tmp_path / "state" / "warm.json").exists()
    assert not (tmp_path / "runs").exists()  # no rank ever started


def test_manifest_checksum_mismatch_names_the_key_and_keeps_it_out_of_the_cache(tmp_path: Path) -> None:
    job = make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    shard = tmp_path / "store" / "data" / "train" / "shard-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(raw))

    rc, out = run_task(driver(job, tmp_path / "state", "warm"), tmp_path / "warm.log")
    assert rc != 0, out[-3000:]
    error = out.split("retrainer: error:")[-1]
    assert "train/shard-00001.bin" in error and ("checksum" in error or "sha256" in error), error
    assert not list((tmp_path / "cache").rglob("shard-00001.bin"))
    assert not (tmp_path / "state" / "warm.json").exists()


def test_checkpoint_from_another_model_is_refused_registry_unchanged(trained: Trained, tmp_path: Path) -> None:
    job = trained.job_for(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    state = trained.state_for(tmp_path)
    metrics = metrics_file(tmp_path, state)
    rc, out = run_task([*driver(job, state, "publish"), "--metrics", str(metrics)], tmp_path / "seed.log")
    assert rc == 0, out[-3000:]
    before = job.registry().show("tiny-llama")
    store_before = snapshot(Path(job.data["publish"]["store_url"]))

    job.update("model", d_model=64, d_ff=128)  # another model: its experiment key differs
    (state / "publish.json").unlink()
    rc, out = run_task([*driver(job, state, "publish"), "--metrics", str(metrics)], tmp_path / "other.log")
    assert rc == 2, out[-3000:]
    assert "checkpoint from another model" in out and trained.run_dir().name in out
    assert job.registry().show("tiny-llama") == before
    assert snapshot(Path(job.data["publish"]["store_url"])) == store_before
    assert not (state / "publish.json").exists()


EVIL = "tiny'; DROP TABLE model_versions; --"


def test_model_name_with_sql_metacharacters_cannot_touch_other_rows(trained: Trained, tmp_path: Path) -> None:
    """Bound parameters all the way: the name is stored verbatim and nothing else changes."""
    job = trained.job_for(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    state = trained.state_for(tmp_path)
    metrics = metrics_file(tmp_path, state)
    rc, out = run_task([*driver(job, state, "publish"), "--metrics", str(metrics)], tmp_path / "seed.log")
    assert rc == 0, out[-3000:]
    before = job.registry().show("tiny-llama")

    job.update("publish", model_name=EVIL)
    rc, out = run_task([*driver(job, state, "publish"), "--metrics", str(metrics)], tmp_path / "evil.log")
    assert "Traceback" not in out, out[-3000:]
    registry = job.registry()
    assert registry.show("tiny-llama") == before  # the other model's versions, aliases, history untouched
    names = {m["model"] for m in registry.models()}
    assert "tiny-llama" in names
    if rc == 0:
        assert [v.version for v in registry.list_versions(EVIL)] == [1]  # stored verbatim, as data


def test_model_name_with_sql_metacharacters_is_refused_at_the_door(tmp_path: Path) -> None:
    job = make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    job.update("publish", model_name=EVIL)
    rc, out = run_task(driver(job, tmp_path / "state", "plan"), tmp_path / "plan.log")
    assert rc == 2, out[-3000:]
    assert "publish.model_name" in out
