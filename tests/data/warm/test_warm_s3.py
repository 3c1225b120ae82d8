"""warm() against a real S3 HTTP endpoint (moto server): round trip, no-op re-warm, corruption, traversal."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tasks.base.errors import InvalidInputError
from tasks.data.warm import warm
from tasks.fetch.fetcher import FetchError
from tests.data.warm.conftest import Tree, assert_dataset_matches, subprocess_env, warm_cmd

PART = 1 << 20  # 1 MiB parts: the 3 MB and 5 MB objects go through the ranged parallel path


def test_round_trip_byte_identical_then_noop(tree: Tree, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = warm(tree.url, cache, storage_options=tree.storage_options, part_size=PART, progress=False)

    assert first.manifest_hash == tree.manifest.hash
    assert first.dataset_dir == cache.resolve() / "datasets" / tree.manifest.hash[:16]
    assert assert_dataset_matches(first.dataset_dir, tree.files) == len(tree.files)
    assert (first.dataset_dir / "manifest.json").read_bytes() == tree.manifest.to_bytes()
    r = first.report
    assert (r.files_fetched, r.bytes_fetched) == (len(tree.files), sum(map(len, tree.files.values())))
    assert r.files_skipped == 0 and r.retries == 0
    assert not list((cache / "partial").rglob("*.part"))

    second = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    assert (second.report.files_fetched, second.report.bytes_fetched) == (0, 0)
    assert second.report.files_skipped == len(tree.files)
    assert second.report.files_verified == 0  # trusted from the record: a stat per file, no hashing

    verified = warm(tree.url, cache, storage_options=tree.storage_options, verify=True, progress=False)
    assert verified.report.files_verified == len(tree.files)
    assert verified.report.files_fetched == 0


def test_local_tampering_is_detected_and_refetched(tree: Tree, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    victim = result.dataset_dir / "train/large-0.bin"
    data = bytearray(victim.read_bytes())
    data[1000] ^= 0xFF
    victim.write_bytes(bytes(data))  # same size, new mtime: no longer trusted by the record

    again = warm(tree.url, cache, storage_options=tree.storage_options, part_size=PART, progress=False)
    assert again.report.files_fetched == 1
    assert again.report.files_verified == 1
    assert victim.read_bytes() == tree.files["train/large-0.bin"]


@pytest.mark.parametrize("key", ["train/small/part-0003.bin", "train/large-0.bin"])
def test_object_changed_behind_manifest_fails_naming_key(small_tree: Tree, tmp_path: Path, key: str) -> None:
    original = small_tree.files[key]
    small_tree.put(key, bytes(b ^ 0x5A for b in original))  # same size, different bytes
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=key) as err:
        warm(small_tree.url, cache, storage_options=small_tree.storage_options, part_size=PART, progress=False)
    assert "sha256" in str(err.value)
    dataset_dir = cache / "datasets" / small_tree.manifest.hash[:16]
    assert not (dataset_dir / key).exists()
    assert not (dataset_dir / "manifest.json").exists()  # an incomplete dataset is never marked complete
    assert_dataset_matches(dataset_dir, {k: v for k, v in small_tree.files.items() if k != key}, complete=False)
    assert not list((cache / "partial").rglob("*.part"))


def test_cli_corrupt_object_exit_code_names_key(small_tree: Tree, tmp_path: Path) -> None:
    key = "train/small/part-0012.bin"
    small_tree.put(key, b"x" + small_tree.files[key])  # different size
    proc = subprocess.run(warm_cmd(small_tree, tmp_path / "cache", "--json", "--workers", "8"), env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert key in proc.stderr and "retrainer: error:" in proc.stderr


def test_cli_json_report(tree: Tree, tmp_path: Path) -> None:
    proc = subprocess.run(warm_cmd(tree, tmp_path / "cache", "--json"), env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["manifest_hash"] == tree.manifest.hash
    assert out["report"]["files_fetched"] == len(tree.files)
    assert out["report"]["mb_per_s"] > 0
    assert_dataset_matches(Path(out["dataset_dir"]), tree.files)


@pytest.mark.parametrize("bad_key", ["../escape.bin", "train/../../escape.bin", "/etc/escape.bin",
                                     "train//x.bin", "train/\x00x.bin", "./x.bin"])
def test_traversal_keys_refused_before_any_write(tree: Tree, tmp_path: Path, bad_key: str) -> None:
    body = json.loads(tree.manifest.to_bytes())
    body["files"].append({"key": bad_key, "size": 3, "sha256": "0" * 64})
    evil = f"evil-{uuid.uuid4().hex[:8]}.json"  # a new object: the shared tree's files stay as they are
    tree.put(evil, json.dumps(body).encode())
    cache = tmp_path / "sub" / "cache"
    with pytest.raises(InvalidInputError, match=r"files\.\d+\.key") as err:
        warm(tree.url, cache, manifest_key=evil, storage_options=tree.storage_options, progress=False)
    assert evil in str(err.value)
    assert not (tmp_path / "sub").exists() or not any(p.is_file() for p in (tmp_path / "sub").rglob("*"))
    assert not (tmp_path / "escape.bin").exists()


def test_plain_s3fs_path_round_trip(small_tree: Tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With obstore switched off, every object (and every ranged part) goes through s3fs."""
    monkeypatch.setenv("RETRAINER_WARM_OBSTORE", "0")
    result = warm(small_tree.url, tmp_path / "cache", storage_options=small_tree.storage_options, part_size=PART,
                  max_workers=4, progress=False)
    assert result.report.files_fetched == len(small_tree.files)
    assert assert_dataset_matches(result.dataset_dir, small_tree.files) == len(small_tree.files)


def test_local_source_url_round_trip(tmp_path: Path) -> None:
    """Any fsspec URL works: a plain local path goes through the thread-pool path."""
    from tasks.data.synthetic import make_data

    made = make_data(str(tmp_path / "src"), name="local", n_train_shards=2, tokens_per_shard=5000)
    result = warm(f"file://{tmp_path / 'src'}", tmp_path / "cache", progress=False)
    assert result.manifest_hash == made.hash
    for f in made.files:
        assert (result.dataset_dir / f.key).read_bytes() == (tmp_path / "src" / f.key).read_bytes()
    assert warm(str(tmp_path / "src"), tmp_path / "cache", progress=False).report.files_fetched == 0
