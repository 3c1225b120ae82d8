"""fsspec destinations and inputs other than local paths: memory://, and S3 (moto's HTTP server) both ways."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec

from tasks.data.manifest import read_manifest
from tests.data.prepare.conftest import texts, tree, write_jsonl, write_parquet
from tests.services import S3Endpoint


def test_memory_destination_gets_the_same_bytes_as_a_local_one(tmp_path: Path, bpe_dir: Path, prepare) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", texts(80, seed=6))
    url = f"memory://prepare-{uuid.uuid4().hex}/ds"
    args = ["--tokenizer", bpe_dir, "--tokens-per-shard", 300, "--heldout-fraction", 0.2, "--name", "ds"]
    try:
        assert prepare(src, "--dest", url, *args).rc == 0
        assert prepare(src, "--dest", tmp_path / "ds", *args).rc == 0
        manifest = read_manifest(url)
        local = tree(tmp_path / "ds")
        fs = fsspec.filesystem("memory")
        assert fs.cat_file(f"{url}/manifest.json") == local["manifest.json"]
        for f in manifest.files:
            blob = fs.cat_file(f"{url}/{f.key}")
            assert blob == local[f.key] and hashlib.sha256(blob).hexdigest() == f.sha256
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def test_s3_inputs_by_glob_and_s3_destination(tmp_path: Path, bpe_dir: Path, s3: S3Endpoint, s3_bucket: str,
                                              prepare) -> None:
    fs = s3.filesystem()
    files = [write_jsonl(tmp_path / "a.jsonl", texts(50, seed=7)), write_parquet(tmp_path / "b.parquet", texts(50, 8))]
    for f in files:
        fs.put_file(str(f), f"{s3_bucket}/in/{f.name}")
    opts = json.dumps(s3.storage_options)
    dest = f"s3://{s3_bucket}/datasets/ds"
    run = prepare(f"s3://{s3_bucket}/in/*", "--tokenizer", bpe_dir, "--dest", dest, "--storage-options", opts,
                  "--name", "ds", "--workers", 2)
    assert run.rc == 0, run.err
    assert run.summary["bad_rows"] == {} and run.summary["files"] == 2
    assert prepare(*files, "--tokenizer", bpe_dir, "--dest", tmp_path / "ds", "--name", "ds").rc == 0
    manifest = read_manifest(dest, s3.storage_options)
    local = tree(tmp_path / "ds")
    assert manifest.to_bytes() == local["manifest.json"]
    assert {f.key: fs.cat_file(f"{s3_bucket}/datasets/ds/{f.key}") for f in manifest.files} == \
        {k: v for k, v in local.items() if k != "manifest.json"}


def test_retrainer_help_loads_neither_tokenizers_nor_pyarrow() -> None:
    probe = ("import sys, tasks.cli; tasks.cli.build_parser(); tasks.cli.build_parser(['prepare-data', '--help']); "
             "print(sorted(m for m in ('tokenizers', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
