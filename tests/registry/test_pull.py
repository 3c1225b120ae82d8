"""`retrainer registry pull`: a version fetched, verified, into a directory, from the registry alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.registry import ArtifactRef, ArtifactStore, Lineage, Registry, upgrade
from tests.registry.conftest import ROOT
from tests.registry.test_tree import model_dir, same_tree

Cli = Callable[..., tuple[int, str, str]]


def publish(url: str, ref: ArtifactRef, tag: str = "step-10") -> int:
    with Registry(url) as reg:
        version = reg.publish_version("m", ref, Lineage("cfg", "data", "rev", tag), {"loss": 1.0}, "ci").version
        reg.switch_alias("m", "production", version, actor="ci", reason="publish", action="publish")
    return version


def test_pull_a_tree_version_from_s3_knowing_only_the_registry(
    registry_url: str, cli: Cli, s3, s3_bucket: str, tmp_path: Path
) -> None:
    upgrade(registry_url)
    store = ArtifactStore(f"s3://{s3_bucket}/models", s3.storage_options)
    src = model_dir(tmp_path / "src")
    ref = store.put_tree(src)
    assert publish(registry_url, ref) == 1
    assert publish(registry_url, store.put_tree(model_dir(tmp_path / "src2")), "step-20") == 2
    opts = ["--db", registry_url, "--storage-options", json.dumps(s3.storage_options)]
    dl = tmp_path / "dl"

    rc, out, err = cli("registry", "pull", "--model", "m", "--version", "1", str(dl / "v1"), *opts, "--json")
    assert rc == 0, err
    assert json.loads(out) | {"dest": "-"} == {"model": "m", "version": 1, "kind": "tree", "digest": ref.digest,
                                               "size_bytes": ref.size, "store": store.url, "dest": "-"}
    assert same_tree(src, dl / "v1")
    rc, out, err = cli("registry", "pull", "--model", "m", str(dl / "live"), *opts)  # default: production
    assert rc == 0 and out.startswith("m v2: tree "), err
    assert same_tree(tmp_path / "src2", dl / "live")

    rc, _, err = cli("registry", "pull", "--model", "m", str(dl / "v1"), *opts)
    assert rc == 2 and "v1: destination exists and is not an empty directory" in err
    rc, _, err = cli("registry", "pull", "--model", "m", "--alias", "staging", str(dl / "x"), *opts)
    assert rc == 2 and "alias 'staging' points to no version" in err
    rc, _, err = cli("registry", "pull", "--model", "m", "--storage-options", "[1]", str(dl / "x"))
    assert rc == 2 and "--storage-options: must be a JSON object" in err

    shard = f"{store.tree_path(ref.digest)}/model-00002-of-00002.safetensors"
    store.fs.pipe_file(shard, b"\0" * store.fs.info(shard)["size"])
    rc, out, err = cli("registry", "pull", "--model", "m", "--version", "1", str(dl / "bad"), *opts)
    assert rc == 1 and out == ""
    assert "model-00002-of-00002.safetensors is corrupt in the store" in err
    assert sorted(p.name for p in dl.iterdir()) == ["live", "v1"]  # no x, no bad, no temporaries


def test_pull_an_old_single_file_version_through_the_real_cli(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    weights = tmp_path / "weights.pt"
    weights.write_bytes(os.urandom(2 * (1 << 20) + 3))
    ref = ArtifactStore(f"file://{tmp_path / 'store'}").put(weights)
    assert ref.kind == "file"
    publish(sqlite_url, ref)
    done = subprocess.run([sys.executable, "-m", "tasks.cli", "registry", "pull", "--model", "m", "--db", sqlite_url,
                           str(tmp_path / "dest")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"m v1: file {ref.digest[:12]}")
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["consolidated.pt"]
    assert (tmp_path / "dest" / "consolidated.pt").read_bytes() == weights.read_bytes()


def test_a_tiny_hugging_face_model_published_as_a_tree_loads_after_pull(
    sqlite_url: str, cli: Cli, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded, with an index, as ranks will write
    written = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in written and "config.json" in written

    upgrade(sqlite_url)
    publish(sqlite_url, ArtifactStore(str(tmp_path / "store")).put_tree(tmp_path / "hf"))
    rc, _, err = cli("registry", "pull", "--model", "m", str(tmp_path / "pulled"), "--db", sqlite_url)
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == written
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pulled").eval()
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("url", ["file:///elsewhere/weights.pt", "s3://bucket/models/sha256/ab/" + "cd" * 32])
def test_pull_needs_the_store_when_the_artifact_url_does_not_name_it(
    sqlite_url: str, cli: Cli, tmp_path: Path, url: str
) -> None:
    upgrade(sqlite_url)
    publish(sqlite_url, ArtifactRef("ab" * 32, url, 1))
    rc, _, err = cli("registry", "pull", "--model", "m", str(tmp_path / "dest"), "--db", sqlite_url)
    assert rc == 2 and "so its store is unknown: give the store" in err
    assert not (tmp_path / "dest").exists()


def test_a_ranks_streamed_export_committed_then_pulled_loads_as_the_trained_weights(
    sqlite_url: str, cli: Cli, job_config: Callable[..., Any], tmp_path: Path
) -> None:
    """The end of a run, then its user: the rank streams its stage's files into the store's staging area,
    publish commits it with the small files, the user pulls the version and loads it with transformers: the
    weights are the trained ones, and every pulled file hashes to what the rank and the version recorded."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.base.fsutil import sha256_file
    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.models.weights import local_named_params
    from tasks.registry.store import local_tree_manifest
    from tasks.stages.publish import commit_staged
    from tasks.train.export import export_stage

    cfg = job_config(sqlite_url)
    store = ArtifactStore(cfg.publish.store_url)
    family = get_family(cfg.model.family)
    trained = family.Reference(cfg.model, seed=3)
    reports = export_stage(trained, cfg.model, TPGroup(), output_dir=tmp_path / "run",
                           tag="step-10", spec={"store_url": store.url, "storage_options": {},
                                                "staging": store.stage(), "dtype": "fp32"})
    assert [r["file"]["path"] for r in reports] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    ref = commit_staged(cfg, store, reports, None)
    upgrade(sqlite_url)
    publish(sqlite_url, ref)

    rc, _, err = cli("registry", "pull", "--model", "m", str(tmp_path / "pulled"), "--db", sqlite_url)
    assert rc == 0, err
    assert local_tree_manifest(tmp_path / "pulled").digest == ref.digest
    for report in reports:
        assert sha256_file(tmp_path / "pulled" / report["file"]["path"]) == report["file"]["sha256"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pulled", dtype=torch.float32).state_dict()
    for name, param in local_named_params(trained):
        assert torch.equal(loaded[family.hf_name(name)], param.detach()), name


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Everything under `root` as a person would compare it: each path with its bytes, or where a link points."""
    return {p.relative_to(root).as_posix(): ("link", os.readlink(p)) if p.is_symlink() else
            ("file", p.read_bytes()) if p.is_file() else ("dir", "") for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("how", ["artifact URL", "--store", "symlinked parent"])
def test_pull_into_the_store_itself_is_refused_naming_the_store(
    sqlite_url: str, cli: Cli, tmp_path: Path, how: str
) -> None:
    upgrade(sqlite_url)
    store = ArtifactStore(str(tmp_path / "store"))
    publish(sqlite_url, store.put_tree(model_dir(tmp_path / "src")))
    if how == "--store":  # the same objects at another place (a mirror, another mount), named on the command line
        subprocess.run(["cp", "-a", str(tmp_path / "store"), str(tmp_path / "mirror")], check=True)
        store = ArtifactStore(str(tmp_path / "mirror"))
    dest = Path(store.root) / "trees" / "mine"
    if how == "symlinked parent":  # DEST's folder is a link into the store
        (tmp_path / "into-store").symlink_to(Path(store.root) / "trees")
        dest = tmp_path / "into-store" / "mine"
    before = snapshot(Path(store.root))

    rc, out, err = cli("registry", "pull", "--model", "m", str(dest), "--db", sqlite_url,
                       *(["--store", store.url] if how == "--store" else []))
    assert (rc, out) == (2, "")
    assert err == f"retrainer: error: {dest}: inside the artifact store {store.url}; pull into a directory outside it\n"
    assert snapshot(Path(store.root)) == before  # no DEST, no temporary beside it, no parent made
    assert not os.path.lexists(dest)


@pytest.mark.parametrize("target", ["an empty folder", "nothing"])
def test_pull_into_a_symlink_is_refused_saying_it_is_a_symlink(
    sqlite_url: str, cli: Cli, tmp_path: Path, target: str
) -> None:
    upgrade(sqlite_url)
    publish(sqlite_url, ArtifactStore(str(tmp_path / "store")).put_tree(model_dir(tmp_path / "src")))
    (tmp_path / "serving").mkdir()
    if target == "an empty folder":
        (tmp_path / "serving" / "v1").mkdir()
    link = tmp_path / "serving" / "production"
    link.symlink_to(tmp_path / "serving" / "v1")
    before = snapshot(tmp_path / "serving")

    rc, out, err = cli("registry", "pull", "--model", "m", str(link), "--db", sqlite_url)
    assert (rc, out) == (2, "")
    assert err == (f"retrainer: error: {link}: destination is a symlink (to {tmp_path / 'serving' / 'v1'}); "
                   "give a directory path that is not a link\n")
    assert snapshot(tmp_path / "serving") == before  # the link and its target as they were, no temporary
