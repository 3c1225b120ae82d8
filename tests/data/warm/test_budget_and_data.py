"""Disk budget + LRU eviction (sparing in-use datasets), and the dataset format (make-data, manifests)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from tasks.base.errors import InvalidInputError
from tasks.data.cache import CacheLayout, DatasetEvictedError, DiskBudgetError, dataset_in_use, make_room, use_lock
from tasks.data.manifest import Manifest, build_manifest, read_manifest
from tasks.data.synthetic import make_data
from tasks.data.warm import warm
from tests.services import S3Endpoint


def _dataset(s3: S3Endpoint, bucket: str, seed: int) -> tuple[str, Manifest]:
    url = f"s3://{bucket}/ds-{seed}"
    return url, make_data(url, name=f"ds-{seed}", n_train_shards=2, n_heldout_shards=1, tokens_per_shard=4096,
                          seed=seed, storage_options=s3.storage_options)


def test_budget_evicts_lru_but_spares_in_use(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (url_a, a), (url_b, b), (url_c, c) = (_dataset(s3, s3_bucket, seed) for seed in (1, 2, 3))
    size = a.total_bytes
    budget = int(2.5 * size)  # room for two datasets
    opts = s3.storage_options

    res_a = warm(url_a, cache, storage_options=opts, disk_budget_bytes=budget, progress=False)
    res_b = warm(url_b, cache, storage_options=opts, disk_budget_bytes=budget, progress=False)
    os.utime(cache / "state" / f"{a.hash[:16]}.used", (1, 1))  # A is least recently used...
    with dataset_in_use(res_a.dataset_dir):  # ...but a trainer holds it
        res_c = warm(url_c, cache, storage_options=opts, disk_budget_bytes=budget, progress=False)
        assert res_c.report.evicted == [b.hash[:16]]
        assert not res_b.dataset_dir.exists()
        assert (res_a.dataset_dir / "train/shard-00000.bin").is_file()

        # Both remaining datasets in use: B cannot fit, and fails before downloading anything.
        with dataset_in_use(res_c.dataset_dir), pytest.raises(DiskBudgetError, match="in use"):
            warm(url_b, cache, storage_options=opts, disk_budget_bytes=budget, progress=False)
        assert not any(p.is_file() for p in res_b.dataset_dir.rglob("*"))

    with pytest.raises(DatasetEvictedError), dataset_in_use(res_b.dataset_dir):
        pass
    # Nothing held now: A is the least recently used and goes.
    again = warm(url_b, cache, storage_options=opts, disk_budget_bytes=budget, progress=False)
    assert again.report.evicted == [a.hash[:16]]
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == sorted([b.hash[:16], c.hash[:16]])


def test_budget_counts_a_dataset_still_being_warmed(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    """Two warms of different datasets cannot both take room that holds one: the first reserved its size."""
    cache = tmp_path / "cache"
    (url_a, a), (url_b, b) = (_dataset(s3, s3_bucket, seed) for seed in (4, 5))
    budget = int(1.5 * a.total_bytes)
    layout = CacheLayout(cache.resolve())
    layout.ensure()
    a_id = layout.dataset_id(a.hash)
    # The moment a warm of A has passed the budget check and holds A in use, before any of its bytes landed:
    with use_lock(layout, a_id):
        make_room(layout, a_id, a.total_bytes, budget)
        assert not any(p.is_file() for p in layout.dataset_dir(a_id).rglob("*"))
        with pytest.raises(DiskBudgetError, match=f"in use \\({a_id}\\)"):
            warm(url_b, cache, storage_options=s3.storage_options, disk_budget_bytes=budget, progress=False)
    assert not (cache / "datasets" / b.hash[:16]).exists()
    # A finishes; B then evicts it (A is no longer in use) and fits.
    warm(url_a, cache, storage_options=s3.storage_options, disk_budget_bytes=budget, progress=False)
    result = warm(url_b, cache, storage_options=s3.storage_options, disk_budget_bytes=budget, progress=False)
    assert result.report.evicted == [a_id]
    assert not layout.size_path(a_id).exists()


def test_dataset_bigger_than_budget_fails_before_download(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    url, m = _dataset(s3, s3_bucket, 9)
    cache = tmp_path / "cache"
    with pytest.raises(DiskBudgetError, match="more than the cache budget"):
        warm(url, cache, storage_options=s3.storage_options, disk_budget_bytes=m.total_bytes - 1, progress=False)
    assert not any(p.is_file() for p in (cache / "datasets").rglob("*"))


def test_make_data_deterministic_and_learnable_text(tmp_path: Path) -> None:
    a = make_data(str(tmp_path / "a"), name="t", seed=5)
    b = make_data(str(tmp_path / "b"), name="t", seed=5)
    c = make_data(str(tmp_path / "c"), name="t", seed=6)
    assert a.hash == b.hash != c.hash
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()
    assert [f.key for f in a.split("train")] == [f"train/shard-0000{i}.bin" for i in range(4)]
    assert [f.key for f in a.split("heldout")] == ["heldout/shard-00000.bin"]
    # Demo defaults: 40 steps x dp 2 x micro-batch 8 x 65 tokens, and 8 x 8 x 65 held out, without repeats.
    train_tokens = sum(f.size for f in a.split("train")) // 2
    assert train_tokens >= 40 * 2 * 8 * 65 * 4
    assert sum(f.size for f in a.split("heldout")) // 2 >= 8 * 8 * 65 * 4
    tokens = np.fromfile(tmp_path / "a/train/shard-00000.bin", dtype="<u2")
    assert tokens.max() < 256 and len(tokens) == 65536
    text = tokens.astype(np.uint8).tobytes().decode("ascii")
    assert len(set(text.split())) > 40  # varied words, not one repeated pattern
    for f in a.files:
        assert hashlib.sha256((tmp_path / "a" / f.key).read_bytes()).hexdigest() == f.sha256


def test_make_data_from_text_files(tmp_path: Path) -> None:
    src = tmp_path / "book.txt"
    src.write_text("It was a bright cold day in April.\n" * 400)
    m = make_data(str(tmp_path / "d"), name="book", n_train_shards=3, n_heldout_shards=1, tokens_per_shard=1000,
                  text_files=[str(src)])
    data = src.read_bytes()
    got = b"".join(np.fromfile(tmp_path / "d" / f.key, dtype="<u2").astype(np.uint8).tobytes()
                   for f in sorted(m.files, key=lambda f: (f.key.startswith("heldout"), f.key)))
    assert got == data[:4000]
    with pytest.raises(InvalidInputError, match=r"missing\.txt"):
        make_data(str(tmp_path / "e"), name="x", text_files=[str(tmp_path / "missing.txt")])


def test_manifest_errors_name_file_and_field() -> None:
    good = {"format": "retrainer-dataset/1", "name": "n", "dtype": "uint16", "vocab_size": 256,
            "files": [{"key": "train/a.bin", "size": 2, "sha256": "a" * 64}]}
    assert Manifest.parse(json.dumps(good).encode(), "m.json").files[0].key == "train/a.bin"
    cases = {
        "files.0.sha256": {**good, "files": [{"key": "train/a.bin", "size": 2, "sha256": "xyz"}]},
        "files.0.size": {**good, "files": [{"key": "train/a.bin", "size": -1, "sha256": "a" * 64}]},
        "format": {**good, "format": "other/2"},
        "dtype": {**good, "dtype": "float32"},
        "files: Value error, duplicate key": {**good, "files": good["files"] * 2},
        "files: Value error, train/a.bin: 3 bytes is not a whole number of uint16 tokens (2 bytes each)":
            {**good, "files": [{"key": "train/a.bin", "size": 3, "sha256": "a" * 64}]},
        "heldout/b.bin: 6 bytes is not a whole number of uint32 tokens": {
            **good, "dtype": "uint32", "files": [{"key": "heldout/b.bin", "size": 6, "sha256": "a" * 64}]},
    }
    for field, body in cases.items():
        with pytest.raises(InvalidInputError, match=f"(?s)^{re.escape('s3://b/m.json')}: .*{re.escape(field)}") as err:
            Manifest.parse(json.dumps(body).encode(), "s3://b/m.json")
        assert "\n" in str(err.value)
    with pytest.raises(InvalidInputError, match=r"m\.json: manifest is not valid JSON"):
        Manifest.parse(b"{nope", "m.json")


def test_build_and_read_manifest_on_s3(s3: S3Endpoint, s3_bucket: str) -> None:
    fs = s3.filesystem()
    blobs = {"train/x.bin": b"\x01\x00" * 100, "heldout/y.bin": b"\x02\x00" * 10}
    fs.pipe({f"{s3_bucket}/p/{k}": v for k, v in blobs.items()})
    built = build_manifest(f"s3://{s3_bucket}/p", storage_options=s3.storage_options)
    assert {f.key: f.sha256 for f in built.files} == {k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()}
    read = read_manifest(f"s3://{s3_bucket}/p", s3.storage_options)
    assert read.hash == built.hash == hashlib.sha256(fs.cat_file(f"{s3_bucket}/p/manifest.json")).hexdigest()
    with pytest.raises(InvalidInputError, match="manifest not found"):
        read_manifest(f"s3://{s3_bucket}/nothing-here", s3.storage_options)


def test_cli_make_data_then_warm_config(tmp_path: Path) -> None:
    """The demo path: `retrainer make-data CONFIG` then `retrainer warm CONFIG` (RETRAINER_HOME-relative URLs)."""
    import subprocess
    import sys

    from tests.data.warm.conftest import ROOT, subprocess_env

    env = dict(subprocess_env(), RETRAINER_HOME=str(tmp_path))
    config = str(ROOT / "configs" / "tiny-llama.yaml")
    made = subprocess.run([sys.executable, "-m", "tasks.cli", "make-data", config],
                          env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    mhash = json.loads(made.stdout)["manifest_hash"]
    # Run again (another seed): refused like prepare-data, naming the dataset, which stays as it was.
    source = tmp_path / "object-store" / "datasets" / "tiny-text"
    again = subprocess.run([sys.executable, "-m", "tasks.cli", "make-data", config, "--seed", "7"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert f"{source}: already holds a dataset (manifest.json, train, heldout): pass --overwrite" in again.stderr
    assert read_manifest(str(source)).hash == mhash
    replaced = subprocess.run([sys.executable, "-m", "tasks.cli", "make-data", config, "--seed", "7", "--overwrite"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert replaced.returncode == 0 and json.loads(replaced.stdout)["manifest_hash"] != mhash, replaced.stderr
    made = subprocess.run([sys.executable, "-m", "tasks.cli", "make-data", config, "--overwrite"],  # the first again
                          env=env, capture_output=True, text=True, timeout=120)
    assert json.loads(made.stdout)["manifest_hash"] == mhash
    warmed = subprocess.run([sys.executable, "-m", "tasks.cli", "warm", config, "--json"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert warmed.returncode == 0, warmed.stderr
    out = json.loads(warmed.stdout)
    assert out["manifest_hash"] == mhash
    assert out["dataset_dir"] == str(tmp_path / "cache" / "datasets" / mhash[:16])
    assert out["report"]["files_fetched"] == 5
    bad = subprocess.run([sys.executable, "-m", "tasks.cli", "warm", str(tmp_path / "nope.yaml")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope.yaml" in bad.stderr

    # A shard cut by one byte (a tool that wrote half a token), its manifest written by hand to match:
    # `retrainer manifest` will not describe it, and warm refuses it naming the file, writing nothing.
    shard = source / "train" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    doc = json.loads((source / "manifest.json").read_text())
    entry = next(f for f in doc["files"] if f["key"] == "train/shard-00001.bin")
    entry.update(size=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (source / "manifest.json").write_text(json.dumps(doc))
    listed = subprocess.run([sys.executable, "-m", "tasks.cli", "manifest", str(source), "--output", "again.json"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 2 and "train/shard-00001.bin" in listed.stderr, listed.stderr
    assert not (source / "again.json").exists()
    before = sorted(p.relative_to(tmp_path / "cache") for p in (tmp_path / "cache").rglob("*") if p.is_file())
    cut = subprocess.run([sys.executable, "-m", "tasks.cli", "warm", config, "--json"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert cut.returncode == 2, cut.stderr
    assert "train/shard-00001.bin: 131071 bytes is not a whole number of uint16 tokens" in cut.stderr, cut.stderr
    assert "Traceback" not in cut.stderr
    after = sorted(p.relative_to(tmp_path / "cache") for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert after == before
