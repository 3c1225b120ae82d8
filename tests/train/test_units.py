"""In-process checks of the sampler, the TP shard layout and the checkpoint pointer/pruning rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config import ModelConfig
from tasks.errors import InvalidInputError
from tasks.models.gpt import Reference as GPT
from tasks.models.gpt import TransformerBlock, shard_spec, unshard
from tasks.models.parallel import TPGroup
from tasks.train import checkpoint as ck
from tasks.train.data import Sampler, TokenWindows


def test_sampler_gives_dp_ranks_disjoint_deterministic_batches() -> None:
    s = Sampler(num_samples=50, micro_batch_size=2, micro_batches=3, dp=2, seed=9)
    assert s.global_batch == 12 and s.steps_per_epoch == 4
    seen: list[int] = []
    for step in range(4):  # one epoch: every window at most once
        per_rank = [np.concatenate(s.rank_micro_batches(step, r)) for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(np.concatenate(per_rank)) == sorted(s.global_indices(step))
        seen.extend(s.global_indices(step))
    assert len(seen) == len(set(seen)) == 48
    again = Sampler(num_samples=50, micro_batch_size=2, micro_batches=3, dp=2, seed=9)
    assert np.array_equal(again.global_indices(5), s.global_indices(5))
    assert s.position(5) == {"step": 5, "epoch": 1, "index": 1}
    assert not np.array_equal(s.global_indices(4), s.global_indices(0))  # new epoch, new permutation
    with pytest.raises(InvalidInputError, match="fewer than one global batch"):
        Sampler(num_samples=11, micro_batch_size=2, micro_batches=3, dp=2, seed=9)


def test_token_windows_refuse_bad_datasets(dataset_dir: Path) -> None:
    windows = TokenWindows(dataset_dir, "train", 16, 256)
    batch = windows.get([0, len(windows) - 1])
    assert batch.shape == (2, 17) and batch.dtype == torch.int64
    with pytest.raises(InvalidInputError, match=r"exceeds model\.vocab_size"):
        TokenWindows(dataset_dir, "train", 16, 100)
    shard = dataset_dir / "train" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(InvalidInputError, match="missing or wrong size"):
        TokenWindows(dataset_dir, "train", 16, 256)
    (dataset_dir / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(InvalidInputError, match=r"manifest\.json: format"):
        TokenWindows(dataset_dir, "train", 16, 256)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_reassemble_to_the_reference_block(tp: int) -> None:
    m = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2 if tp == 2 else 4, d_ff=64)
    full = TransformerBlock(m, 1, seed=3).state_dict()
    shards = [TransformerBlock(m, 1, seed=3, tp=TPGroup(None, r, tp)).state_dict() for r in range(tp)]
    for name, tensor in full.items():
        pieces = [s[name] for s in shards]
        torch.testing.assert_close(unshard(m, f"blocks.1.{name}", pieces), tensor, rtol=0, atol=0)
        if shard_spec(m, name, 0, tp) is not None:
            assert pieces[0].numel() * tp == tensor.numel()
    assert set(GPT(m).state_dict()) >= {f"blocks.1.{n}" for n in full}


def test_pointer_prune_and_sweep(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    assert ck.read_latest(root) is None
    from tasks.run import RunIdentity, StartingWeights

    run = RunIdentity("k", "f", "d", "url", StartingWeights("scratch"))
    marker = {"experiment_key": "k", "config_fingerprint": "f"}
    for step in (2, 4, 6):
        tmp = root / f"tmp-{ck.tag_for(step)}"
        tmp.mkdir()
        (tmp / "payload").write_bytes(b"x")
        ck.finalize(root, ck.tag_for(step), {**marker, "step": step}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000004", "step-000006"]
    assert ck.find_resume(root, run) == ("step-000006", {**marker, "step": 6})
    (root / "tmp-step-000008").mkdir()
    ck.sweep_incomplete(root)
    assert not (root / "tmp-step-000008").exists()
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(InvalidInputError, match="not a checkpoint tag"):
        ck.read_latest(root)


def test_config_refuses_tp_with_zero0_and_clipping(make_config) -> None:
    from tasks.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.zero_stage 0 with parallel\.tp > 1"):
        make_config({"parallel.tp": 2, "parallel.zero_stage": 0})
