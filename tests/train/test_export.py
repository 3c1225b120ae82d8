"""The ranks' export (tasks/train/export.py): the stage's files streamed once into the store, tensor by tensor,
at once (a thread each), by a process that never loads the registry's database layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tasks import REPO_ROOT
from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import sha256_file
from tasks.base.safetensors_stream import PIECE, TensorEntry, write
from tasks.registry.store import ArtifactStore

ROOT = REPO_ROOT
# ~66M parameters (265 MB fp32, a 132 MB bf16 shard): big enough that a stage held twice would show.
MODEL = {"family": "llama", "vocab_size": 32000, "seq_len": 128, "n_layers": 8, "d_model": 512, "n_heads": 8,
         "n_kv_heads": 4, "d_ff": 2048, "rope_theta": 10000.0}


def test_a_rank_streams_its_shard_without_a_second_copy_of_the_stage_or_the_database_layer(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    staging = store.stage()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("export_rss_worker.py")), "--store", store.url,
         "--staging", staging, "--out", str(tmp_path / "run"), "--model", json.dumps(MODEL)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.splitlines()[-1])

    assert r["sqlalchemy"] is False  # the rank imported the store, not the registry's database layer
    shard_bytes = r["held_bytes"] // 2  # fp32 held, bf16 exported
    in_flight = 2 * PIECE  # per file, a piece being hashed and written and the next converted: 2 * PIECE in all
    assert r["peak_added_bytes"] < in_flight + (16 << 20) < shard_bytes / 2, r
    reports = r["reports"]
    assert [x["file"]["path"] for x in reports] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    names: list[str] = []
    for i, report in enumerate(reports):
        file = report["file"]
        path = Path(staging.removeprefix("file://")) / file["path"]
        assert (path.stat().st_size, sha256_file(path)) == (file["size"], file["sha256"])
        assert json.loads((tmp_path / "run" / "export" / "step-1" / f"shard-0000{i}.json").read_text()) == report
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            assert sorted(keys) == sorted(report["weights"])
            names += keys
            if "model.embed_tokens.weight" in keys:
                embed = f.get_tensor("model.embed_tokens.weight")
                assert embed.dtype == torch.bfloat16 and embed.shape == (32000, 512)
    assert sorted(names) == names and len(names) == 2 + 8 * 9 + 1  # every tensor once, in name order
    sizes = [x["file"]["size"] for x in reports]
    assert max(sizes) < 2 * shard_bytes / 4, sizes  # four files of comparable size: four cores can hash them


def test_a_stage_is_cut_into_files_of_about_equal_bytes_none_empty() -> None:
    from tasks.models.export import split_stage

    assert split_stage([10, 10, 10, 10, 10, 10, 10, 10]) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_stage([100, 1, 1, 1, 1, 1]) == [range(0, 1), range(1, 2), range(2, 3), range(3, 6)]
    assert split_stage([1, 1, 1, 1, 1, 100]) == [range(0, 3), range(3, 4), range(4, 5), range(5, 6)]
    assert split_stage([1, 2, 3, 4]) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="a stage of 3 tensors cannot fill 4 files"):
        split_stage([1, 2, 3])


def test_a_file_that_fails_ends_every_file_of_the_stage_and_leaves_nothing_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or any error) in one file's writer: the export raises it, its partial file is removed and no
    file is reported (a retry exports again; housekeeping removes a staging area no version took)."""
    from tasks.config.model import ModelConfig
    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.train import export as export_module

    failed: list[str] = []

    def failing(sink: object, entries: list[TensorEntry], tensors: object, *args: object) -> None:
        if entries[-1].name == "model.norm.weight":  # the stage's last file
            failed.append(entries[0].name)
            raise OSError(28, "No space left on device")
        write(sink, entries, tensors, *args)

    monkeypatch.setattr(export_module, "write_safetensors", failing)
    m = ModelConfig.model_validate({**MODEL, "vocab_size": 256, "n_layers": 2, "d_model": 64, "n_heads": 4,
                                    "n_kv_heads": 2, "d_ff": 128})
    store = ArtifactStore(str(tmp_path / "store"))
    staging = store.stage()
    with pytest.raises(OSError, match="No space left on device"):
        export_module.export_stage(get_family("llama").Reference(m, seed=1), m, TPGroup(),
                                   output_dir=tmp_path / "run", tag="step-1",
                                   spec={"store_url": store.url, "storage_options": {}, "staging": staging,
                                         "dtype": "bf16"})
    left = sorted(p.name for p in Path(staging.removeprefix("file://")).iterdir())
    assert failed and "model-00004-of-00004.safetensors" not in left  # the file that failed
    for name in left:  # what other threads finished is whole
        with safe_open(str(Path(staging.removeprefix("file://")) / name), "pt") as f:
            keys = list(f.keys())
            assert keys and all(f.get_tensor(k).numel() > 0 for k in keys)
    assert not (tmp_path / "run" / "export").exists()  # no report: a retry exports again


def test_a_failed_stream_leaves_nothing_in_the_staging_area(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    staging = store.stage()
    entries = [TensorEntry("a", torch.float32, (4,)), TensorEntry("b", torch.float32, (4,))]
    wrong = [("a", torch.zeros(4)), ("b", torch.zeros(5))]
    with pytest.raises(InvalidInputError, match="tensor 1 is"):
        store.stage_stream(staging, "model.safetensors", lambda sink: write(sink, entries, iter(wrong)))
    assert list(Path(staging.removeprefix("file://")).iterdir()) == []


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_ranks_export_writes_the_very_bytes_of_the_export_from_checkpoint_files(
    tmp_path: Path, family: str
) -> None:
    """Same weights, same shard bytes (same tree digest) whichever export wrote them: the ranks' stream or
    publish's fallback from the checkpoint's layer files (`safetensors.torch.save_file`)."""
    from tasks.config.model import ModelConfig
    from tasks.models import get_family
    from tasks.models.export import export_checkpoint
    from tasks.models.parallel import TPGroup
    from tasks.train.export import export_stage
    from tests.checkpoints import write_layer_files

    m = ModelConfig.model_validate({**MODEL, "family": family, "vocab_size": 256, "n_layers": 2, "d_model": 64,
                                    "n_heads": 4, "n_kv_heads": 2, "d_ff": 128})
    module = get_family(family).Reference(m, seed=1)
    write_layer_files(tmp_path / "ckpt", m, module.state_dict())
    export_checkpoint(m, tmp_path / "ckpt", tmp_path / "fallback", stages=1, dtype="bf16")
    store = ArtifactStore(str(tmp_path / "store"))
    staging = store.stage()
    reports = export_stage(module, m, TPGroup(), output_dir=tmp_path / "run",
                           tag="step-1", spec={"store_url": store.url, "storage_options": {}, "staging": staging,
                                               "dtype": "bf16"})
    files = sorted(p.name for p in (tmp_path / "fallback").glob("*.safetensors"))
    assert [r["file"]["path"] for r in reports] == files and len(files) == 4
    for file in files:
        ours = Path(staging.removeprefix("file://")) / file
        assert ours.read_bytes() == (tmp_path / "fallback" / file).read_bytes()
