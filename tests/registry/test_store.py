"""Content-addressed artifact store on a local folder and on S3 (moto HTTP server via s3fs)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from tasks.registry import ArtifactStore, CorruptArtifactError, NotFoundError


@pytest.fixture(params=["local", "file-url", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ArtifactStore, Any]:
    """(store, raw filesystem + root) so tests can tamper with stored bytes behind the store's back."""
    if request.param == "local":
        s = ArtifactStore(str(tmp_path / "store"))
    elif request.param == "file-url":
        s = ArtifactStore(f"file://{tmp_path / 'store'}")
    else:
        s3 = request.getfixturevalue("s3")
        bucket = request.getfixturevalue("s3_bucket")
        s = ArtifactStore(f"s3://{bucket}/models", s3.storage_options)
    return s


def _blob(tmp_path: Path, data: bytes, name: str = "w.pt") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_put_get_roundtrip_content_addressed(store: ArtifactStore, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # several read chunks
    digest = hashlib.sha256(data).hexdigest()
    ref = store.put(_blob(tmp_path, data))
    assert ref.digest == digest and ref.size == len(data)
    assert ref.url.endswith(f"/sha256/{digest[:2]}/{digest}")
    assert store.exists(digest) and store.verify(digest)
    out = store.get(digest, tmp_path / "dl" / "w.pt")
    assert out.read_bytes() == data
    # No temporary objects are left behind.
    leftovers = [p for p in store.fs.find(store.root) if "/sha256/" not in p]
    assert leftovers == []


def test_put_skips_when_present_and_repairs_corrupt_copy(store: ArtifactStore, tmp_path: Path) -> None:
    data = b"weights" * 1000
    ref = store.put(_blob(tmp_path, data))
    path = store.path_for(ref.digest)
    before = store.fs.info(path)
    assert store.put(_blob(tmp_path, data, "again.pt")) == ref
    after = store.fs.info(path)
    assert after.get("mtime", after.get("LastModified")) == before.get("mtime", before.get("LastModified"))
    # Corrupt the stored object (same size): put() notices and uploads good bytes again.
    with store.fs.open(path, "wb") as fh:
        fh.write(b"X" * len(data))
    store.fs.invalidate_cache()
    assert not store.verify(ref.digest)
    store.put(_blob(tmp_path, data, "third.pt"))
    assert store.verify(ref.digest)


def test_corrupt_artifact_download_is_refused_and_leaves_nothing(store: ArtifactStore, tmp_path: Path) -> None:
    data = b"good bytes " * 5000
    ref = store.put(_blob(tmp_path, data))
    with store.fs.open(store.path_for(ref.digest), "wb") as fh:
        fh.write(data[:-1] + b"!")  # one flipped byte
    store.fs.invalidate_cache()
    dest = tmp_path / "dl" / "w.pt"
    with pytest.raises(CorruptArtifactError, match="corrupt"):
        store.get(ref.digest, dest)
    assert not dest.exists()
    assert list((tmp_path / "dl").iterdir()) == []  # no temp file either
    # An existing good file at dest survives a refused download.
    dest.write_bytes(b"previous")
    with pytest.raises(CorruptArtifactError):
        store.get(ref.digest, dest)
    assert dest.read_bytes() == b"previous"


def test_missing_artifact(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="not found"):
        store.get("0" * 64, tmp_path / "x")
    assert not (tmp_path / "x").exists()
