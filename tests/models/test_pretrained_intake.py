"""A hostile or broken Hugging Face folder (`model.pretrained`) as a team hands it over, through the CLI.

Paths that leave the folder (a symlink to a credentials file, an index naming `../x.safetensors`) are refused
when the config is loaded (`retrainer plan`); what the files hold (a NaN or Inf weight, a shape or dtype other
than config.json's, a tokenizer id past vocab_size) when the folder enters the cache (`retrainer run`'s warm,
before any rank). Each: exit 2, one error line naming the file and the tensor, index or token, no traceback,
nothing cached, trained or published. A clean folder (a symlink inside it included) is checked once.
The models are built here with transformers (tests/models/test_hf_import_export.py): nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tasks.registry import Registry
from tests.models.test_hf_import_export import ROOT, make_hf_llama
from tests.services import free_port
from tests.test_weekly_retrain import retrainer

VOCAB = 256  # make-data's token ids are below 256
TENSOR = "model.layers.0.mlp.up_proj.weight"  # (ffn 64, hidden 32)


def job(tmp: Path, hf: Path, data: Path | None = None) -> Path:
    """A one-rank job that starts from the team's folder, everything it writes under `tmp`."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"] = {"pretrained": str(hf), "seq_len": 32}
    cfg["parallel"] = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "micro_batches": 1}
    cfg["train"].update(steps=2, checkpoint_every=2, micro_batch_size=2, warmup_steps=1, lr=1e-3,
                        output_dir=str(tmp / "runs"), init_from="pretrained")
    cfg["data"].update(source_url=str(data or tmp / "store" / "corpus"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=2)
    cfg["publish"].update(registry_url=f"sqlite:///{tmp / 'registry.db'}", store_url=str(tmp / "store" / "models"),
                          export_dtype="fp32", model_name="team-llama")
    path = tmp / "team-llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Llama folder (three shards and their index, a tokenizer) and one dataset for the module."""
    root = tmp_path_factory.mktemp("built")
    make_hf_llama(root / "hf", vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=2, ffn=64, shard="40KB")
    made = retrainer("make-data", str(job(root, root / "hf")), "--tokens-per-shard", "16384", tmp=root)
    assert made.returncode == 0, made.stderr[-2000:]
    return root


@pytest.fixture
def team(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the team's folder: a fresh copy, its job config): the module's data, everything else under tmp_path."""
    hf = tmp_path / "models" / "team-llama"
    shutil.copytree(built / "hf", hf)
    return hf, job(tmp_path, hf, data=built / "store" / "corpus")


def shard_of(hf: Path, tensor: str) -> Path:
    return hf / json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def rewrite(hf: Path, tensor: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """Replace one tensor of its shard (as a broken upload would), the rest as it was; the shard."""
    from safetensors.torch import load_file, save_file

    shard = shard_of(hf, tensor)
    tensors = load_file(shard)
    tensors[tensor] = change(tensors[tensor].clone())
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def refused(done: subprocess.CompletedProcess[str], *names: str) -> str:
    """The one error line of a refusal (exit 2, no traceback), naming each of `names`."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("retrainer: error:")]
    assert len(errors) == 1 and all(name in errors[0] for name in names), (names, done.stderr[-3000:])
    return errors[0]


def nothing_written(tmp: Path) -> None:
    """No cache entry of the model (not even a partial one), no run directory, nothing in the registry or store."""
    models = tmp / "cache" / "models"
    assert not [p.name for p in models.iterdir() if p.is_dir()] if models.exists() else True
    assert not (tmp / "runs").exists()
    store = tmp / "store" / "models"
    assert not [p for p in store.rglob("*") if p.is_file()] if store.exists() else True
    if (tmp / "registry.db").exists():
        assert Registry(f"sqlite:///{tmp / 'registry.db'}").models() == []


def test_a_symlink_to_a_file_outside_the_folder_is_refused_at_config_load(team: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    hf, config = team
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("[default]\naws_secret_access_key = s3cr3t\n")
    (hf / "special_tokens_map.json").symlink_to(secret)  # would be published beside the tokenizer

    error = refused(retrainer("plan", str(config), tmp=tmp_path), f"{hf}/special_tokens_map.json",
                    str(secret), "outside the folder")
    assert "s3cr3t" not in error
    nothing_written(tmp_path)


def test_a_hub_cache_snapshot_is_refused_saying_how_to_materialise_it(built: Path, tmp_path: Path) -> None:
    """The Hub's cache links each file of `snapshots/<rev>/` to `../../blobs/<hash>`, outside the snapshot."""
    hub = tmp_path / "hub" / "models--team--llama"
    snapshot = hub / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (hub / "blobs").mkdir()
    for file in sorted((built / "hf").iterdir()):
        shutil.copy(file, hub / "blobs" / file.name)
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)

    refused(retrainer("plan", str(job(tmp_path, snapshot)), tmp=tmp_path), f"{snapshot}/config.json",
            "outside the folder", "--local-dir", "cp -rL")
    nothing_written(tmp_path)


@pytest.mark.parametrize("where", ["../x.safetensors", "absolute"])
def test_an_index_entry_naming_a_file_outside_the_folder_is_refused_at_config_load(
        team: tuple[Path, Path], tmp_path: Path, where: str) -> None:
    hf, config = team
    shard = shard_of(hf, TENSOR)
    outside = hf.parent / "x.safetensors"
    shard.rename(outside)
    name = where if where != "absolute" else str(outside)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: name if v == shard.name else v for k, v in index["weight_map"].items()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))

    refused(retrainer("plan", str(config), tmp=tmp_path), "model.safetensors.index.json", repr(name))
    nothing_written(tmp_path)


@pytest.mark.parametrize(("value", "kind"), [(float("nan"), "NaN"), (float("-inf"), "Inf")])
def test_a_non_finite_weight_is_refused_as_it_enters_the_cache_naming_tensor_and_index(
        team: tuple[Path, Path], tmp_path: Path, value: float, kind: str) -> None:
    hf, config = team

    def poison(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[1234] = value
        t.view(-1)[2000] = value
        return t

    shard = rewrite(hf, TENSOR, poison)
    done = retrainer("run", str(config), tmp=tmp_path)
    refused(done, f"{shard.name}: tensor {TENSOR} holds {kind} at flat index 1234;")
    assert "launching" not in done.stderr  # no rank started
    nothing_written(tmp_path)


@pytest.mark.parametrize(("change", "said"), [
    (lambda t: t[:, :31].contiguous(), f"tensor {TENSOR}) has shape (64, 31), the model config needs (64, 32)"),
    (lambda t: t.to(torch.float16), f"tensor {TENSOR} is F16, config.json says F32"),
    (lambda t: t.to(torch.int32), f"tensor {TENSOR} is I32, config.json says F32"),
], ids=["shape", "F16", "I32"])
def test_a_tensor_other_than_config_json_says_is_refused_as_it_enters_the_cache(
        team: tuple[Path, Path], tmp_path: Path, change: Callable[[torch.Tensor], torch.Tensor], said: str) -> None:
    hf, config = team
    rewrite(hf, TENSOR, change)
    done = retrainer("run", str(config), tmp=tmp_path)
    refused(done, f"model.pretrained {hf}", said)
    assert "launching" not in done.stderr
    nothing_written(tmp_path)


def test_a_tokenizer_id_past_vocab_size_is_refused_as_it_enters_the_cache(team: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    hf, config = team
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": VOCAB, "content": "<tool_call>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))

    done = retrainer("run", str(config), tmp=tmp_path)
    refused(done, "tokenizer.json: token '<tool_call>' has id 256, config.json's vocab_size is 256")
    assert "launching" not in done.stderr
    nothing_written(tmp_path)


def test_a_clean_folder_with_a_symlink_inside_enters_the_cache_once_checked(team: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    hf, config = team
    (hf / "blobs").mkdir()
    (hf / "tokenizer.json").rename(hf / "blobs" / "tokenizer")
    (hf / "tokenizer.json").symlink_to(Path("blobs") / "tokenizer")  # a link that stays inside is followed

    first = retrainer("run", str(config), "--dry-run", tmp=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"model: {hf} checked: every tensor finite" in first.stderr
    [entry] = [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]
    assert not entry.name.endswith(".partial")
    copied = entry / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (hf / "blobs" / "tokenizer").read_bytes()

    again = retrainer("run", str(config), "--dry-run", tmp=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"model: {hf} checked" not in again.stderr and "every float finite" not in again.stderr  # not again
    assert "(0 fetched, 0 bytes" in again.stderr


def test_the_finite_check_finds_the_first_bad_element_whatever_the_pieces_a_copy_streams() -> None:
    """Pieces of any size cut the header and the elements anywhere; mixed dtypes put tensors at odd offsets."""
    from safetensors.torch import save

    from tasks.base.errors import InvalidInputError
    from tasks.models.intake import FiniteCheck

    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8]
    for _ in range(200):
        tensors = {f"t{j}": (torch.randn(rng.randint(0, 40)) * 3).to(rng.choice(dtypes)) for j in range(4)}
        floats = [n for n, t in tensors.items() if t.dtype.is_floating_point and t.numel()]
        expected = None
        if floats and rng.random() < 0.7:
            name = rng.choice(floats)
            index = rng.randrange(tensors[name].numel())
            tensors[name][index] = rng.choice([float("nan"), float("inf")])
            tensors[name][index:] = tensors[name][index]  # any later element is bad too: the first is named
            kind = "NaN" if tensors[name][index].isnan() else "Inf"
            expected = f"tensor {name} holds {kind} at flat index {index};"
        raw, check, at = memoryview(save(tensors)), FiniteCheck("f.safetensors"), 0
        try:
            while at < raw.nbytes:
                step = rng.choice([1, 3, 7, 8, 13, 64, 1000])
                check.feed(raw[at:at + step])
                at += step
            check.finish()
            got = None
        except InvalidInputError as exc:
            got = str(exc)
        assert (got is None) if expected is None else (got is not None and expected in got), (got, expected)
