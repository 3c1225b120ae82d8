"""Content-addressed trees: the manifest format, and staging -> commit -> verified download on a local
folder and on S3 (moto HTTP server via s3fs), with real writer processes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tasks.base.errors import InvalidInputError
from tasks.registry import ArtifactStore, CorruptArtifactError, NotFoundError
from tasks.registry.tree import FORMAT, MANIFEST_NAME, TreeFile, TreeManifest
from tests.registry import tree_writer


@pytest.fixture(params=["local", "s3"])
def store_and_options(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ArtifactStore, dict[str, Any]]:
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store")), {}
    s3 = request.getfixturevalue("s3")
    bucket = request.getfixturevalue("s3_bucket")
    return ArtifactStore(f"s3://{bucket}/models", s3.storage_options), s3.storage_options


@pytest.fixture
def store(store_and_options: tuple[ArtifactStore, dict[str, Any]]) -> ArtifactStore:
    return store_and_options[0]


def model_dir(root: Path) -> Path:
    """A model-like folder: nested paths, a multi-chunk shard, an empty file."""
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model-00001-of-00002.safetensors": os.urandom(3 * (1 << 20) + 5),
        "model-00002-of-00002.safetensors": os.urandom(1000),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
        "tokenizer/extra/added_tokens.txt": b"",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def same_tree(a: Path, b: Path) -> bool:
    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    return files(a) == files(b)


def store_files(store: ArtifactStore) -> list[str]:
    store.fs.invalidate_cache()
    return sorted(p[len(store.root) + 1:] for p in store.fs.find(store.root))


def tf(path: str, data: bytes) -> TreeFile:
    return TreeFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


# -- the manifest ---------------------------------------------------------------------------


def test_manifest_is_canonical_and_its_digest_is_the_sha256_of_its_bytes() -> None:
    a, b = tf("b/x.bin", b"xx"), tf("a.json", b"{}")
    m = TreeManifest.of([a, b.to_dict()])
    assert [f.path for f in m.files] == ["a.json", "b/x.bin"]  # sorted, whatever the writers' order
    raw = m.to_bytes()
    assert raw == json.dumps({"format": FORMAT, "files": [b.to_dict(), a.to_dict()]}, sort_keys=True,
                             separators=(",", ":")).encode()
    assert m.digest == hashlib.sha256(raw).hexdigest() and m.size == 4
    assert TreeManifest.from_bytes(raw) == m
    with pytest.raises(InvalidInputError, match="canonical"):
        TreeManifest.from_bytes(json.dumps(json.loads(raw), indent=1).encode())
    with pytest.raises(InvalidInputError, match="not a retrainer-tree/1 manifest"):
        TreeManifest.from_bytes(b'{"format": "other", "files": []}')


@pytest.mark.parametrize(("files", "message"), [
    ([tf("../x", b"")], r"files\[0\]\.path: key '\.\./x' has an empty, '\.' or '\.\.' segment"),
    ([tf("/etc/passwd", b"")], "absolute"),
    ([tf(MANIFEST_NAME, b"")], "reserved for the manifest"),
    ([tf("a", b""), tf("a", b"")], "a is listed twice"),
    ([tf("a", b""), tf("a/b", b"")], "a is both a file and a folder"),
    ([TreeFile("a", -1, "0" * 64)], r"files\[0\]\.size \(a\): must be a non-negative integer"),
    ([TreeFile("a", 1, "XYZ")], r"files\[0\]\.sha256 \(a\): not a sha256 hex digest"),
    ([{"path": "a", "size": 1}], "exactly path, size, sha256"),
    ([], "lists no file"),
])
def test_manifest_refuses_bad_entries_naming_them(files: list[Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        TreeManifest.of(files)


# -- staging, commit, download ----------------------------------------------------------------


def test_put_tree_get_tree_roundtrip_with_nested_paths(store: ArtifactStore, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    ref = store.put_tree(src)
    assert ref.kind == "tree" and ref.size == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert ref.url == store.fs.unstrip_protocol(f"{store.root}/trees/{ref.digest[:2]}/{ref.digest}")
    assert ArtifactStore.root_of(ref.url, ref.digest, "tree") == store.url
    manifest = store.tree_manifest(ref.digest)
    assert len(manifest.files) == 5 and manifest.digest == ref.digest
    prefix = f"trees/{ref.digest[:2]}/{ref.digest}/"
    assert store_files(store) == sorted([prefix + MANIFEST_NAME] + [prefix + f.path for f in manifest.files])
    assert store.verify_tree(ref.digest)
    out = store.get_tree(ref.digest, tmp_path / "dl" / "model")
    assert same_tree(src, out)
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["model"]  # no temporary left beside it
    assert store.put_tree(src) == ref  # idempotent: same digest, staging discarded
    assert store_files(store) == sorted([prefix + MANIFEST_NAME] + [prefix + f.path for f in manifest.files])


def test_files_of_many_copy_buffers_are_recorded_and_pulled_with_their_own_sha256(
    store: ArtifactStore, tmp_path: Path
) -> None:
    from tasks.base.fastcopy import BUFFER
    from tasks.base.fsutil import sha256_file

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i, size in enumerate((3 * BUFFER + 5, 2 * BUFFER, 1)):
        (src / ("sub" if i else "") / f"shard-{i}.bin").write_bytes(os.urandom(size))
    ref = store.put_tree(src)
    for f in store.tree_manifest(ref.digest).files:
        assert f.sha256 == sha256_file(src / f.path), f.path
    assert store.verify_tree(ref.digest)
    assert same_tree(src, store.get_tree(ref.digest, tmp_path / "pulled"))


def test_concurrent_writer_processes_fill_one_staging_area_then_one_commit(
    store_and_options: tuple[ArtifactStore, dict[str, Any]], tmp_path: Path
) -> None:
    store, options = store_and_options
    staging = store.stage()
    paths = [f"model-{i + 1:05d}-of-00004.safetensors" for i in range(3)] + ["tokenizer/tokenizer.json"]
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(tree_writer.write, store.url, options, staging, p, i, str(tmp_path))
                   for i, p in enumerate(paths)]
        reports = [f.result(timeout=120) for f in futures]
    ref = store.commit_tree(staging, TreeManifest.of(reversed(reports)))
    out = store.get_tree(ref.digest, tmp_path / "dest")
    for i, p in enumerate(paths):
        assert (out / p).read_bytes() == tree_writer.payload(i)
    assert not [p for p in store_files(store) if p.startswith("tmp/")]  # the staging area is gone


def test_commit_refuses_missing_wrong_size_or_unlisted_files_and_commits_nothing(
    store: ArtifactStore, tmp_path: Path
) -> None:
    (tmp_path / "a").write_bytes(b"aaaa")
    staging = store.stage()
    good = store.stage_file(staging, "a", tmp_path / "a")
    store.stage_file(staging, "sub/b", tmp_path / "a")
    store.stage_file(staging, "stray", tmp_path / "a")
    manifest = TreeManifest.of([good, TreeFile("sub/b", 5, good.sha256), TreeFile("c/missing.bin", 4, good.sha256)])
    with pytest.raises(InvalidInputError) as err:
        store.commit_tree(staging, manifest)
    assert str(err.value) == (f"tree commit refused, nothing committed (staging {staging} kept): "
                              "c/missing.bin is missing; sub/b is 4 bytes, the manifest says 5; "
                              "stray is not in the manifest")
    assert not [p for p in store_files(store) if p.startswith("trees/")]
    with pytest.raises(NotFoundError):
        store.tree_manifest(manifest.digest)
    with pytest.raises(InvalidInputError, match="is not a staging area"):
        store.commit_tree(staging.replace("/tmp/", "/trees/"), manifest)
    with pytest.raises(InvalidInputError, match="is not a staging area"):
        store.stage_file(f"{staging}/../../sha256", "x", tmp_path / "a")
    store.discard(staging)
    assert store_files(store) == []


def test_recommit_of_a_committed_tree_is_skipped_and_leaves_it_untouched(store: ArtifactStore, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    ref = store.put_tree(src)
    shard = f"{store.tree_path(ref.digest)}/model-00002-of-00002.safetensors"
    before = store.fs.info(shard)
    staging = store.stage()
    entries = [store.stage_file(staging, f.path, src / f.path) for f in store.tree_manifest(ref.digest).files]
    assert store.commit_tree(staging, TreeManifest.of(entries)) == ref
    store.fs.invalidate_cache()
    after = store.fs.info(shard)
    assert after.get("mtime", after.get("LastModified")) == before.get("mtime", before.get("LastModified"))
    assert not [p for p in store_files(store) if p.startswith("tmp/")]


@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_corrupt_tree_is_refused_on_download_naming_the_file(
    store: ArtifactStore, tmp_path: Path, damage: str
) -> None:
    ref = store.put_tree(model_dir(tmp_path / "src"))
    victim = f"{store.tree_path(ref.digest)}/tokenizer/tokenizer.json"
    if damage == "flipped byte":
        with store.fs.open(victim, "wb") as fh:
            fh.write(b'{"version": "1.1"}')  # same size
    else:
        store.fs.rm_file(victim)
    store.fs.invalidate_cache()
    assert not store.verify_tree(ref.digest)
    what = "is corrupt in the store" if damage == "flipped byte" else "is missing from the store"
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptArtifactError, match=f"tokenizer/tokenizer.json {what}"):
        store.get_tree(ref.digest, out / "dest")
    assert list(out.iterdir()) == []  # no dest, no temporary directory
    (out / "empty").mkdir()
    with pytest.raises(CorruptArtifactError):
        store.get_tree(ref.digest, out / "empty")
    assert list(out.iterdir()) == [out / "empty"] and list((out / "empty").iterdir()) == []


PART = 1 << 20  # the store's part size in these tests: the 3 MB shard is pulled as 4 ranged parts


class WatchedSource:
    """The store's real reader (obstore on moto's server), with every ranged read it is asked for noted; `fail`
    names (key, start) of one part whose first read fails as a dropped connection would. Each file's first part
    waits for another file's: two files must be in flight at the same time."""

    def __init__(self, inner: Any, fail: tuple[str, int] | None) -> None:
        self.inner = inner
        self.name = inner.name
        self.fail = fail
        self.ranges: list[tuple[str, int, int]] = []
        self._together = threading.Barrier(2, timeout=10)
        self._waited: set[str] = set()
        self._lock = threading.Lock()

    def read(self, key: str) -> Any:
        return self.inner.read(key)

    def read_range(self, key: str, start: int, end: int) -> Any:
        with self._lock:
            self.ranges.append((key, start, end))
            failing = self.fail == (key, start)
            if failing:
                self.fail = None
            wait = start == 0 and key not in self._waited and len(self._waited) < 2
            self._waited.add(key)
        if wait:
            self._together.wait()
        if failing:
            raise ConnectionResetError(f"injected: connection reset reading {key} at {start}")
        return self.inner.read_range(key, start, end)

    def stream(self, key: str) -> Any:
        return self.inner.stream(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)


class WatchedList(list[WatchedSource]):
    """The readers a pull opened; `fail` is handed to the next one."""

    fail: tuple[str, int] | None = None


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> WatchedList:
    """Every reader the store opens for a pull is a `WatchedSource` around the real one."""
    import tasks.registry.store as store_module

    real = store_module.open_source
    opened = WatchedList()

    def watching(*args: Any) -> WatchedSource:
        opened.append(WatchedSource(real(*args), opened.fail))
        return opened[-1]

    monkeypatch.setattr(store_module, "open_source", watching)
    return opened


def two_large_shards(root: Path) -> Path:
    src = model_dir(root)
    (src / "model-00002-of-00002.safetensors").write_bytes(os.urandom(PART + 1))  # one byte over: two parts
    return src


def test_a_tree_on_s3_is_pulled_in_ranged_parts_several_files_at_once_bit_for_bit(
    s3, s3_bucket: str, tmp_path: Path, watched: WatchedList
) -> None:
    store = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options, part_size=PART)
    src = two_large_shards(tmp_path / "src")
    ref = store.put_tree(src)

    reader = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options, part_size=PART)  # a serving node's
    assert reader.get_tree(ref.digest, tmp_path / "out") == tmp_path / "out"
    assert same_tree(src, tmp_path / "out")
    manifest, source = watched  # the tree's manifest and then its files, through obstore (s3fs is never built)
    assert manifest.ranges == [] and "fs" not in vars(reader)
    assert type(source.inner).__name__ == "ObstoreS3Source"  # these options have an obstore equivalent
    big = (3 << 20) + 5
    assert sorted(source.ranges) == [
        ("model-00001-of-00002.safetensors", start, min(start + PART, big)) for start in range(0, big, PART)
    ] + [("model-00002-of-00002.safetensors", 0, PART), ("model-00002-of-00002.safetensors", PART, PART + 1)]


def test_a_part_that_fails_once_is_retried_and_the_pull_completes(
    s3, s3_bucket: str, tmp_path: Path, watched: WatchedList, caplog: pytest.LogCaptureFixture
) -> None:
    store = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options, part_size=PART)
    src = two_large_shards(tmp_path / "src")
    ref = store.put_tree(src)
    watched.fail = ("model-00001-of-00002.safetensors", 2 * PART)

    with caplog.at_level("WARNING", logger="tasks.registry.store"):
        store.get_tree(ref.digest, tmp_path / "out")
    assert same_tree(src, tmp_path / "out")
    assert watched[-1].ranges.count(("model-00001-of-00002.safetensors", 2 * PART, 3 * PART)) == 2
    assert "pull: retrying (attempt 1 failed): injected: connection reset" in caplog.text


def test_a_large_file_corrupt_in_the_store_is_refused_naming_it_and_nothing_is_written(
    s3, s3_bucket: str, tmp_path: Path
) -> None:
    store = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options, part_size=PART)
    ref = store.put_tree(two_large_shards(tmp_path / "src"))
    victim = f"{store.tree_path(ref.digest)}/model-00001-of-00002.safetensors"
    data = bytearray(store.fs.cat_file(victim))
    data[PART + 10] ^= 0xFF  # one byte, in its second part; same size
    store.fs.pipe_file(victim, bytes(data))
    out = tmp_path / "out"
    out.mkdir()

    with pytest.raises(CorruptArtifactError, match=r"model-00001-of-00002\.safetensors is corrupt in the store") as err:
        store.get_tree(ref.digest, out / "dest")
    assert "refused, nothing written" in str(err.value)
    assert list(out.iterdir()) == []  # no dest, no temporary directory, no partial files


def test_get_tree_refuses_a_non_empty_destination_and_unknown_trees(store: ArtifactStore, tmp_path: Path) -> None:
    ref = store.put_tree(model_dir(tmp_path / "src"))
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "keep.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="dest: destination exists and is not an empty directory"):
        store.get_tree(ref.digest, tmp_path / "dest")
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["keep.txt"]
    with pytest.raises(NotFoundError, match=f"tree {'0' * 64} not found"):
        store.get_tree("0" * 64, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_s3_commit_copies_server_side_and_never_reads_the_bytes(s3, s3_bucket: str, tmp_path: Path) -> None:
    store = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options)
    src = model_dir(tmp_path / "src")
    staging = store.stage()
    manifest = TreeManifest.of(store.stage_file(staging, p.relative_to(src).as_posix(), p)
                               for p in sorted(src.rglob("*")) if p.is_file())
    calls: list[str] = []
    real = store.fs._call_s3

    async def spy(method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return await real(method, *args, **kwargs)

    store.fs._call_s3 = spy
    try:
        store.commit_tree(staging, manifest)
    finally:
        del store.fs._call_s3
    assert calls.count("copy_object") == len(manifest.files) and "put_object" in calls  # files, then the manifest
    assert not {"get_object", "upload_part"} & set(calls)
