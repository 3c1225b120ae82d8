"""Hostile model/alias names: stored verbatim via bound parameters, or refused with a clear error."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import sqlalchemy as sa

from tasks.registry import ArtifactRef, ArtifactStore, InvalidNameError, Lineage, Registry, upgrade
from tasks.registry.db import make_engine

STORED = [
    "robert'); DROP TABLE registry_versions; --",
    'double "quoted" name',
    "semi;colon; DELETE FROM registry_alias_history",
    "../../../etc/passwd",
    "模型-🚀-ünïcödé",
    "percent %s %(x)s {} :param",
    "back\\slash",
    "x" * 200,
]
REFUSED = [
    ("", "must not be empty"),
    ("x" * 10_000, "too long"),
    ("nul\x00byte", "control"),
    ("new\nline", "control"),
    (" padded ", "whitespace"),
]


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    with engine.connect() as conn:
        names = set(sa.inspect(conn).get_table_names())
    engine.dispose()
    return names


@pytest.mark.parametrize("name", STORED)
def test_hostile_names_are_stored_verbatim(registry_url: str, name: str, tmp_path: Path) -> None:
    upgrade(registry_url)
    before = _tables(registry_url)
    store = ArtifactStore(str(tmp_path / "store"))
    blob = tmp_path / "w.bin"
    blob.write_bytes(name.encode())
    artifact = store.put(blob)
    with Registry(registry_url) as reg:
        v = reg.publish_version(name, artifact, Lineage(name, name, name, name), {name: 1}, name)
        reg.switch_alias(name, name, v.version, actor=name, reason=name)
        assert reg.live_version(name, name).version == 1
        assert reg.get_version(name, 1).checkpoint_tag == name
        assert reg.history(name, name)[0].alias == name
        assert [m["model"] for m in reg.models()] == [name]
    assert _tables(registry_url) == before  # nothing was executed
    # Names never form store paths: the only file is the content-addressed one, inside the store.
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert files == [tmp_path / "store" / "sha256" / artifact.digest[:2] / artifact.digest]


@pytest.mark.parametrize(("name", "why"), REFUSED)
def test_bad_names_are_refused_clearly(registry_url: str, name: str, why: str) -> None:
    upgrade(registry_url)
    ref = ArtifactRef(hashlib.sha256(b"x").hexdigest(), "file:///x", 1)
    with Registry(registry_url) as reg:
        with pytest.raises(InvalidNameError, match=f"model: .*{why}"):
            reg.publish_version(name, ref, Lineage("c", "d", "r", "t"), {}, "alice")
        reg.publish_version("ok", ref, Lineage("c", "d", "r", "t"), {}, "alice")
        with pytest.raises(InvalidNameError, match=f"alias: .*{why}"):
            reg.switch_alias("ok", name, 1, actor="alice", reason="")
        assert reg.models() == [{"model": "ok", "versions": 1, "aliases": {}}]


@pytest.mark.parametrize("digest", ["../../etc/passwd", "AB" * 32, "a" * 63, "g" * 64, "../" + "a" * 61])
def test_store_refuses_non_digest_keys(tmp_path: Path, digest: str) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(InvalidNameError, match="not a sha256 hex digest"):
        store.get(digest, tmp_path / "out")
    assert not (tmp_path / "out").exists()
