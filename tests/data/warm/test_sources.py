"""Which client reads a source (obstore for S3 where it is equivalent, else fsspec), a second S3 server that
ignores ranges, and what a no-op re-warm costs: no pydantic, no botocore."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.base.object_source import FsspecSource, ObstoreS3Source, open_source
from tasks.data.warm import warm
from tests.data.warm.conftest import RcloneS3, Tree, assert_dataset_matches, subprocess_env

ENDPOINT = {"endpoint_url": "http://127.0.0.1:9"}  # never contacted: building a source opens no connection


@pytest.mark.parametrize(("opts", "env_key", "expected"), [
    ({"key": "AKIAEXAMPLE", "secret": "wJalrSECRET", "client_kwargs": ENDPOINT}, False, ObstoreS3Source),
    ({"anon": True, "client_kwargs": ENDPOINT}, False, ObstoreS3Source),
    ({"client_kwargs": ENDPOINT}, True, ObstoreS3Source),  # keys from AWS_ACCESS_KEY_ID / _SECRET_ACCESS_KEY
    ({"client_kwargs": ENDPOINT}, False, FsspecSource),  # a profile or an instance role: botocore's chain
    ({"key": "k", "secret": "s", "client_kwargs": {**ENDPOINT, "verify": False}}, False, FsspecSource),
    ({"key": "k", "secret": "s", "profile": "p", "client_kwargs": ENDPOINT}, False, FsspecSource),
    ({"key": "k", "secret": "s"}, False, FsspecSource),  # AWS itself, region unknown: botocore finds it
])
def test_obstore_only_where_it_matches_s3fs(opts: dict, env_key: bool, expected: type,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
                "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    if env_key:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    source = open_source("s3://bucket/prefix", opts, 4)
    assert type(source) is expected
    assert "s3://bucket/prefix" in source.name  # what error messages name: the URL and endpoint, no secret
    assert "SECRET" not in source.name and "AKIA" not in source.name


def test_switch_and_other_protocols_use_fsspec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_source(f"file://{tmp_path}", None, 4), FsspecSource)
    monkeypatch.setenv("RETRAINER_WARM_OBSTORE", "0")
    assert isinstance(open_source("s3://b/p", {"key": "k", "secret": "s", "client_kwargs": ENDPOINT}, 4),
                      FsspecSource)


def test_server_that_ignores_ranges_gets_whole_streams(rclone_s3: RcloneS3, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`rclone serve s3` answers a ranged GET with HTTP 200: large objects are then streamed whole, verified."""
    rng = random.Random(3)
    files = {f"train/s-{i}.bin": rng.randbytes(2 * rng.randint(1, 2500)) for i in range(30)}  # whole tokens
    files |= {"train/big-0.bin": rng.randbytes(3 << 20), "train/big-1.bin": rng.randbytes((2 << 20) + 6)}
    base = rclone_s3.root / "bkt" / "ds"
    for key, data in files.items():
        (base / key).parent.mkdir(parents=True, exist_ok=True)
        (base / key).write_bytes(data)
    manifest = {"format": "retrainer-dataset/1", "name": "r", "files": [
        {"key": k, "size": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in sorted(files.items())]}
    (base / "manifest.json").write_text(json.dumps(manifest))

    with caplog.at_level(logging.WARNING, logger="tasks.data.warm"):
        result = warm("s3://bkt/ds", tmp_path / "cache", storage_options=rclone_s3.storage_options,
                      part_size=1 << 20, progress=False)
    assert result.report.files_fetched == len(files) and result.report.retries == 0
    assert assert_dataset_matches(result.dataset_dir, files) == len(files)
    assert sum("answers ranged GETs with whole objects" in r.getMessage() for r in caplog.records) == 1
    again = warm("s3://bkt/ds", tmp_path / "cache", storage_options=rclone_s3.storage_options, progress=False)
    assert (again.report.files_fetched, again.report.files_skipped) == (0, len(files))


NOOP_PROBE = r"""
import json, sys, tasks.cli
rc = tasks.cli.main(sys.argv[1:])
heavy = sorted(m for m in ("pydantic", "fsspec", "s3fs", "botocore", "aiobotocore", "tenacity", "torch")
               if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_noop_rewarm_loads_no_pydantic_fsspec_or_botocore(tree: Tree, tmp_path: Path) -> None:
    """The fast path is real: a re-warm of a complete dataset needs none of the heavy imports."""
    cache = tmp_path / "cache"
    argv = ["warm-url", tree.url, str(cache), "--storage-options", json.dumps(tree.storage_options), "--json"]
    cold = subprocess.run([sys.executable, "-c", NOOP_PROBE, *argv], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert "pydantic" in json.loads(cold.stdout.splitlines()[-1])["heavy"]  # a cold warm validates the manifest
    noop = subprocess.run([sys.executable, "-c", NOOP_PROBE, *argv], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert noop.returncode == 0, noop.stderr[-2000:]
    report = json.loads("\n".join(noop.stdout.splitlines()[:-1]))["report"]
    assert (report["files_fetched"], report["files_skipped"]) == (0, len(tree.files))
    assert json.loads(noop.stdout.splitlines()[-1]) == {"rc": 0, "heavy": []}


def test_aws_proper_with_a_region_uses_obstore_virtual_hosted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    opts = {"key": "k", "secret": "s", "client_kwargs": {"region_name": "eu-west-1"}}
    source = open_source("s3://bucket/prefix", opts, 4)
    assert isinstance(source, ObstoreS3Source)
    assert source.store.config["virtual_hosted_style_request"] in (True, "true")  # obstore echoes it as a string
    assert source.store.config["region"] == "eu-west-1"


def test_a_record_from_before_the_complete_flag_is_upgraded_by_the_next_warm(tree: Tree, tmp_path: Path) -> None:
    """A cache completed by older code (state without `complete`) re-warms once the slow way, then the fast way."""
    cache = tmp_path / "cache"
    first = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    state = cache.resolve() / "state" / f"{first.manifest_hash[:16]}.json"
    data = json.loads(state.read_bytes())
    del data["complete"]
    state.write_text(json.dumps(data))
    slow = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    assert slow.parsed is not None  # not recognised as complete: validated and checked the full way
    assert slow.report.files_fetched == 0
    assert json.loads(state.read_bytes())["complete"] is True
    fast = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    assert fast.parsed is None and fast.report.files_skipped == len(tree.files)
