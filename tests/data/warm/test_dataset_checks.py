"""A hostile or broken dataset is refused at warm (or, cached already, at plan) before any rank starts: a token
id the model has no row for, an empty split, a manifest whose dtype contradicts the bytes, a shard that is a
symlink out of the dataset folder. Each as the person meets it through the CLI: exit 2, one error line naming
the shard / id / field, no traceback, nothing under a final name in the cache, no run directory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tasks import REPO_ROOT
from tasks.base.errors import InvalidInputError
from tasks.data.synthetic import make_data
from tasks.data.tokens import ShardRules, TokenScan
from tasks.data.warm import warm
from tasks.inputs.node import node_spec, warm_node
from tasks.runs.identity import identity, scratch
from tests.train.conftest import tiny_config

ROOT = REPO_ROOT
TRAIN_SHARDS = 4


def job(tmp_path: Path, *, vocab_size: int = 256, name: str = "job.yaml", tokens_per_shard: int = 4096,
        **sections: dict) -> Path:
    """The demo config on a fresh 4+1-shard dataset under tmp_path (byte tokens, ids < 256)."""
    data = tmp_path / "store" / "data"
    if not (data / "manifest.json").exists():
        make_data(str(data), name="tiny-llama", n_train_shards=TRAIN_SHARDS, tokens_per_shard=tokens_per_shard)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"]["vocab_size"] = vocab_size
    cfg["data"].update(source_url=str(data), cache_dir=str(tmp_path / "cache"))
    cfg["train"]["output_dir"] = str(tmp_path / "runs")
    cfg["publish"].update(registry_url=f"sqlite:///{tmp_path / 'registry.db'}",
                          store_url=str(tmp_path / "store" / "models"))
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def manifest_of(data: Path) -> dict:
    return json.loads((data / "manifest.json").read_text())


def rewrite(data: Path, key: str, content: bytes, **manifest: object) -> None:
    """Write `content` at `key` and make the manifest say so (the data's author wrote both): the shard
    verifies, whatever it holds."""
    (data / key).write_bytes(content)
    doc = {**manifest_of(data), **manifest}
    for f in doc["files"]:
        if f["key"] == key:
            f.update(size=len(content), sha256=hashlib.sha256(content).hexdigest())
    (data / "manifest.json").write_text(json.dumps(doc))


def tokens(data: Path, key: str, dtype: str = "<u2") -> np.ndarray:
    return np.fromfile(data / key, dtype=dtype).copy()


def retrainer(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tasks.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def refused(proc: subprocess.CompletedProcess[str], *names: str) -> str:
    """The one error line of a refusal (exit 2), which names each of `names`."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("retrainer: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


def nothing_cached(tmp_path: Path) -> None:
    """No dataset file under a final name, no record or stamp of one, no run directory (no rank ever started)."""
    cache = tmp_path / "cache"
    assert not [p for p in (cache / "datasets").rglob("*")], list((cache / "datasets").rglob("*"))
    assert not [p for p in (cache / "state").rglob("*")], list((cache / "state").rglob("*"))
    assert not (tmp_path / "runs").exists()


def test_a_token_id_beyond_the_vocabulary_in_a_train_shard_is_refused_at_warm(tmp_path: Path) -> None:
    """Shards of 1.2 MB are committed one by one as they land: the refusal takes back those that did."""
    config = job(tmp_path, tokens_per_shard=600_000)
    data = tmp_path / "store" / "data"
    ids = tokens(data, "train/shard-00002.bin")
    ids[1234] = 300
    rewrite(data, "train/shard-00002.bin", ids.tobytes())

    error = refused(retrainer("warm", str(config)), "train/shard-00002.bin", "token id 300", "model.vocab_size 256")
    assert "data.source_url" in error
    nothing_cached(tmp_path)


def test_a_token_id_equal_to_the_vocabulary_in_a_heldout_shard_stops_the_run_before_any_rank(tmp_path: Path) -> None:
    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    ids = tokens(data, "heldout/shard-00000.bin")
    ids[-1] = 256  # the last token: ids run 0 .. vocab_size - 1
    rewrite(data, "heldout/shard-00000.bin", ids.tobytes())

    refused(retrainer("run", str(config)), "heldout/shard-00000.bin", "token id 256", "model.vocab_size 256")
    nothing_cached(tmp_path)


@pytest.mark.parametrize(("split", "how", "says"), [
    ("train", "empty", "every train/ file is empty"),
    ("train", "none", "no train/ files"),
    ("heldout", "empty", "every heldout/ file is empty"),
    ("heldout", "none", "no heldout/ files"),
])
def test_an_empty_split_is_refused_at_warm_before_anything_is_written(tmp_path: Path, split: str, how: str,
                                                                     says: str) -> None:
    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    keys = [f["key"] for f in manifest_of(data)["files"] if f["key"].startswith(f"{split}/")]
    for key in keys:
        rewrite(data, key, b"")
    if how == "none":
        doc = manifest_of(data)
        doc["files"] = [f for f in doc["files"] if f["key"] not in keys]
        (data / "manifest.json").write_text(json.dumps(doc))

    refused(retrainer("warm", str(config)), "manifest.json", says)
    assert not (tmp_path / "cache" / "datasets").exists()  # refused from the manifest: not even a directory
    assert not (tmp_path / "runs").exists()


def test_an_empty_shard_beside_others_is_no_empty_split(tmp_path: Path) -> None:
    """One empty shard of a split with tokens is fine: it warms, and the split's windows skip it."""
    from tasks.models.resolve import load_config
    from tasks.train.data import TokenWindows

    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    rewrite(data, "train/shard-00001.bin", b"")
    proc = retrainer("warm", str(config), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_config(config)
    windows = TokenWindows(json.loads(proc.stdout)["dataset_dir"], "train", cfg.model.seq_len, cfg.model.vocab_size)
    assert len(windows) == (TRAIN_SHARDS - 1) * len(range(0, 4096 - cfg.model.seq_len, cfg.model.seq_len))


def test_uint32_tokens_under_a_uint16_manifest_are_refused_naming_the_shard(tmp_path: Path) -> None:
    """Every id is below the vocabulary read either way; only the dtype check sees that each second uint16 is 0."""
    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    for f in manifest_of(data)["files"]:
        rewrite(data, f["key"], tokens(data, f["key"]).astype("<u4").tobytes())

    refused(retrainer("warm", str(config)), "shard-0000", "looks like uint32 tokens", "manifest's uint16",
            "contradicts the bytes")
    nothing_cached(tmp_path)


def test_uint16_tokens_under_a_uint32_manifest_are_refused_by_their_ids(tmp_path: Path) -> None:
    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    rewrite(data, "train/shard-00000.bin", (data / "train" / "shard-00000.bin").read_bytes(), dtype="uint32")

    error = refused(retrainer("warm", str(config)), "shard-0000", "not below model.vocab_size 256")
    assert int(error.split("token id ")[1].split(",")[0]) >= 1 << 16  # two byte tokens read as one
    nothing_cached(tmp_path)


def test_a_shard_that_is_a_symlink_out_of_the_dataset_folder_is_refused_and_never_copied(tmp_path: Path) -> None:
    config = job(tmp_path)
    data = tmp_path / "store" / "data"
    secret = tmp_path / "credentials"
    secret.write_bytes(b"aws_secret_access_key=hunter2\n" * 64)
    shard = data / "train" / "shard-00001.bin"
    rewrite(data, "train/shard-00001.bin", secret.read_bytes())  # the manifest the author wrote names its bytes
    shard.unlink()
    shard.symlink_to(secret)

    refused(retrainer("warm", str(config)), "train/shard-00001.bin", str(secret), "outside")
    nothing_cached(tmp_path)
    assert not any(b"hunter2" in p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file())


def test_a_manifest_that_is_a_symlink_out_of_the_dataset_folder_is_refused(tmp_path: Path) -> None:
    config = job(tmp_path)
    manifest = tmp_path / "store" / "data" / "manifest.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(elsewhere)

    refused(retrainer("warm", str(config)), "manifest.json", str(elsewhere), "outside")
    nothing_cached(tmp_path)


def test_a_symlink_inside_the_dataset_folder_and_a_linked_folder_still_warm(tmp_path: Path) -> None:
    real = tmp_path / "snapshots" / "2026-12-01"
    make_data(str(real), name="tiny-llama", n_train_shards=2, tokens_per_shard=4096)
    first, second = real / "train" / "shard-00000.bin", real / "train" / "shard-00001.bin"
    rewrite(real, "train/shard-00001.bin", first.read_bytes())
    second.unlink()
    second.symlink_to(first)  # a deduplicated shard: the link stays in the folder
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "data").symlink_to(real)  # `latest` -> a snapshot: the root itself is a link
    proc = retrainer("warm", str(job(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_link_planted_in_the_cache_never_leads_a_write_out_of_it(tmp_path: Path) -> None:
    config = job(tmp_path)
    digest = hashlib.sha256((tmp_path / "store" / "data" / "manifest.json").read_bytes()).hexdigest()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = tmp_path / "cache" / "datasets" / digest[:16]
    planted.mkdir(parents=True)
    (planted / "train").symlink_to(elsewhere)

    refused(retrainer("warm", str(config)), str(planted / "train"), "outside the cache's dataset directory")
    assert not list(elsewhere.iterdir())


def test_a_dataset_cached_for_a_larger_vocabulary_is_refused_at_plan(tmp_path: Path) -> None:
    wide = job(tmp_path, vocab_size=512, name="wide.yaml")
    data = tmp_path / "store" / "data"
    ids = tokens(data, "train/shard-00003.bin")
    ids[7] = 300
    rewrite(data, "train/shard-00003.bin", ids.tobytes())
    warmed = retrainer("warm", str(wide), "--json")
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    dataset_dir = Path(json.loads(warmed.stdout)["dataset_dir"])
    state = json.loads((tmp_path / "cache" / "state" / f"{dataset_dir.name}.json").read_text())
    assert state["max_token_id"] == 300 and state["max_token_id_by_split"]["train"] == 300
    assert state["files"]["train/shard-00003.bin"][3] == 300
    cached = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()}

    narrow = job(tmp_path, vocab_size=256)
    for verb in ("plan", "run"):
        refused(retrainer(verb, str(narrow)), dataset_dir.name, "train/shard-00003.bin", "token id 300",
                "model.vocab_size 256", "cached at")
    assert not (tmp_path / "runs").exists()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()} == cached

    # `retrainer warm` refuses it from the record too: the no-op re-warm, and a warm that re-hashes one touched
    # file and trusts the others. The dataset stays cached for the model that can read it.
    refused(retrainer("warm", str(narrow)), "train/shard-00003.bin", "token id 300")
    os.utime(dataset_dir / "heldout" / "shard-00000.bin")
    refused(retrainer("warm", str(narrow)), "train/shard-00003.bin", "token id 300")
    assert (dataset_dir / "manifest.json").is_file() and (dataset_dir / "train" / "shard-00003.bin").is_file()
    assert retrainer("warm", str(wide)).returncode == 0


def test_replay_and_suite_sources_are_checked_too(tmp_path: Path) -> None:
    old = tmp_path / "store" / "old"
    make_data(str(old), name="tiny-llama", seed=9, n_train_shards=1, tokens_per_shard=4096)
    ids = tokens(old, "train/shard-00000.bin")
    ids[0] = 999
    rewrite(old, "train/shard-00000.bin", ids.tobytes())
    with_replay = job(tmp_path, name="replay.yaml", data={"replay": [{"source_url": str(old), "weight": 0.1}]})
    refused(retrainer("warm", str(with_replay)), "data.replay[0].source_url", "train/shard-00000.bin", "token id 999")

    # A suite's own dataset is warmed by the evaluation ranks; cached already, plan refuses it.
    suite = tmp_path / "store" / "suite"
    make_data(str(suite), name="suite", seed=5, n_train_shards=1, tokens_per_shard=4096)
    ids = tokens(suite, "heldout/shard-00000.bin")
    ids[0] = 400
    rewrite(suite, "heldout/shard-00000.bin", ids.tobytes())
    assert retrainer("warm-url", str(suite), str(tmp_path / "cache")).returncode == 0  # no model: only recorded
    suites = {"suites": [{"name": "heldout"}, {"name": "other", "source_url": str(suite)}]}
    refused(retrainer("plan", str(job(tmp_path, name="suites.yaml", evaluate=suites))),
            "evaluate.suites[1].source_url", "heldout/shard-00000.bin", "token id 400")


def test_each_node_warm_runs_the_same_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ssh, Slurm and Kubernetes nodes warm through tasks/inputs/node.py: the spec carries the model's vocabulary
    and each source's splits, and the node refuses the shard as the warm stage does."""
    src = tmp_path / "src"
    make_data(str(src), name="tiny-test", n_train_shards=2, tokens_per_shard=4096)
    ids = tokens(src, "train/shard-00001.bin")
    ids[3] = 256
    rewrite(src, "train/shard-00001.bin", ids.tobytes())
    cfg = tiny_config(tmp_path)
    run = identity(cfg, hashlib.sha256((src / "manifest.json").read_bytes()).hexdigest(), scratch(cfg))
    monkeypatch.setenv("NODE_NAME", "node-3")
    with pytest.raises(InvalidInputError, match=r"train/shard-00001\.bin holds token id 256, not below "
                                                r"model\.vocab_size 256"):
        warm_node(node_spec(cfg, run, run.run_dir(cfg)))
    nothing_cached(tmp_path)


def test_a_token_cut_by_a_part_boundary_is_read_whole(tmp_path: Path) -> None:
    """Ranged parts of an odd size cut tokens in two: the scan completes each from the next part."""
    src = tmp_path / "src"
    make_data(str(src), name="tiny-test", n_train_shards=1, tokens_per_shard=4096)
    ids = tokens(src, "train/shard-00000.bin")
    ids[500] = 0x1234  # bytes 1000-1001: the part boundary at byte 1001 cuts it
    rewrite(src, "train/shard-00000.bin", ids.tobytes())
    rules = ShardRules(vocab_size=0x1234, splits=("train",), field="data.source_url")
    with pytest.raises(InvalidInputError, match=f"holds token id {0x1234}, not below"):
        warm(str(src), tmp_path / "cache", part_size=1001, progress=False, rules=rules)

    rng = np.random.default_rng(0)
    for dtype, wider in (("uint16", "<u4"), ("uint32", None)):
        raw = rng.integers(0, 1 << 16, 10_000, dtype="<u4").astype("<u2" if dtype == "uint16" else "<u4").tobytes()
        scan, at = TokenScan(dtype), 0
        while at < len(raw):
            step = int(rng.integers(1, 37))
            scan.update(raw[at:at + step])
            at += step
        found = scan.result()
        assert found.max_id == int(np.frombuffer(raw, "<u2" if dtype == "uint16" else "<u4").max())
        assert found.wider_max == (int(np.frombuffer(raw, wider).max()) if wider else None)


def test_a_clean_dataset_warms_records_its_ids_and_rewarms_without_reading_a_byte(tmp_path: Path) -> None:
    config = job(tmp_path)
    first = retrainer("warm", str(config), "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    dataset_dir = Path(json.loads(first.stdout)["dataset_dir"])
    state = json.loads((tmp_path / "cache" / "state" / f"{dataset_dir.name}.json").read_text())
    assert state["max_token_id"] < 128 and set(state["max_token_id_by_split"]) == {"train", "heldout"}

    # Same size and mtime, other bytes: a warm that read the file again would find it changed and fetch it.
    shard = dataset_dir / "train" / "shard-00000.bin"
    st = shard.stat()
    shard.write_bytes(b"\xff" * st.st_size)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = retrainer("warm", str(config), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads(again.stdout)["report"]
    assert (report["files_fetched"], report["files_verified"], report["files_skipped"]) == (0, 0, TRAIN_SHARDS + 1)
    assert shard.read_bytes() == b"\xff" * st.st_size


def test_a_record_without_token_ids_is_rehashed_locally_once(tmp_path: Path) -> None:
    """A cache warmed before token ids were recorded: the next warm re-reads the local files (no transfer)
    to learn them, and the warm after that is a no-op again."""
    config = job(tmp_path)
    assert retrainer("warm", str(config)).returncode == 0
    (state_path,) = (tmp_path / "cache" / "state").glob("*.json")
    state = json.loads(state_path.read_text())
    state["files"] = {k: v[:3] for k, v in state["files"].items()}
    for key in ("dtype", "vocab_size", "max_token_id", "max_token_id_by_split"):
        del state[key]
    state_path.write_text(json.dumps(state))

    reports = []
    for _ in range(2):
        proc = retrainer("warm", str(config), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports.append(json.loads(proc.stdout)["report"])
    files = TRAIN_SHARDS + 1
    assert [(r["files_fetched"], r["files_verified"]) for r in reports] == [(0, files), (0, 0)]
    assert json.loads(state_path.read_text())["files"]["train/shard-00000.bin"][3] is not None
