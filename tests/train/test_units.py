"""In-process checks of the sampler, the TP shard layout and the checkpoint pointer/pruning rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tasks.base.errors import InvalidInputError, TrainingFailedError
from tasks.base.layout import ORIGIN, Coord, Layout
from tasks.config.model import ModelConfig
from tasks.models.gpt.model import Reference as GPT
from tasks.models.gpt.model import TransformerBlock
from tasks.models.gpt.sharding import shard_spec, unshard
from tasks.models.parallel import TPGroup
from tasks.train import async_save
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


def test_single_source_sampler_draws_what_it_always_drew() -> None:
    """Without replay the indices are the earlier single-source ones (benchmarks and references rely on it)."""
    s = Sampler(num_samples=1000, micro_batch_size=4, micro_batches=2, dp=2, seed=7)
    for step in (0, 1, 30, 31, 62, 500):  # 62 steps per epoch: both sides of an epoch boundary
        epoch, index = divmod(step, s.steps_per_epoch)
        then = np.random.default_rng([7, epoch]).permutation(1000)[index * 16 : (index + 1) * 16]
        assert np.array_equal(s.global_indices(step), then)


def test_a_source_is_shuffled_once_an_epoch_not_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of an epoch reads one permutation of the source's windows, drawn once (a 100B-token split at
    seq 4096 has 24M windows: 1.3 s a draw, which every step of every rank paid, twice on a chat step)."""
    draws: list[list[int]] = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda key: draws.append(list(key)) or real(key))
    s = Sampler(num_samples=1000, micro_batch_size=4, micro_batches=2, dp=2, seed=7)
    for step in range(2 * s.steps_per_epoch):
        s.global_indices(step)
        s.rank_micro_batches(step, 1)
    assert draws == [[7, 0], [7, 1]]


def mixture_sampler() -> Sampler:
    return Sampler(num_samples=1000, micro_batch_size=4, micro_batches=2, dp=1, seed=7,
                   replay=((300, 0.05), (200, 0.1)))


def _sources(idx: np.ndarray) -> list[int]:
    return [int((idx < 1000).sum()), int(((idx >= 1000) & (idx < 1300)).sum()), int((idx >= 1300).sum())]


def test_mixture_draws_each_source_by_weight_and_each_step_sums_to_the_batch() -> None:
    s = mixture_sampler()
    totals = np.zeros(3, dtype=int)
    for step in range(1000):
        idx = s.global_indices(step)
        assert len(idx) == s.global_batch == 8 and idx.max() < 1500
        per_source = _sources(idx)
        assert per_source == [b - a for a, b in zip(s.drawn(step), s.drawn(step + 1), strict=True)]
        totals += per_source
        # At every step each replay source is within one sample of its exact share so far.
        assert all(abs(got - w * 8 * (step + 1)) < 1 for got, w in zip(s.drawn(step + 1)[1:], (0.05, 0.1),
                                                                          strict=True))
    assert totals.tolist() == [6800, 400, 800]  # 85 / 5 / 10 of 8000
    # Within a source, one pass over its stream visits each of its windows once per epoch.
    replay = np.concatenate([s.global_indices(step) for step in range(1000)])
    first = replay[(replay >= 1000) & (replay < 1300)][:296]  # 296 = 300 rounded down to whole batches
    assert len(set(first.tolist())) == 296


def test_mixture_is_a_pure_function_of_the_step() -> None:
    """A resumed run (a fresh sampler, asked for step 437 first) draws what an unbroken one drew."""
    unbroken = mixture_sampler()
    walked = [unbroken.global_indices(step) for step in range(440)]
    resumed = mixture_sampler()
    for step in (437, 438, 439, 3, 0):
        assert np.array_equal(resumed.global_indices(step), walked[step])
        assert all(np.array_equal(a, b) for a, b in zip(resumed.rank_micro_batches(step, 0),
                                                        unbroken.rank_micro_batches(step, 0), strict=True))
    # The primary's stream is its own: mixing in replay does not reseed it, only thins it.
    alone = Sampler(num_samples=1000, micro_batch_size=4, micro_batches=2, dp=1, seed=7)
    primary = np.concatenate(walked)
    primary = primary[primary < 1000]
    assert np.array_equal(primary[:80], np.concatenate([alone.global_indices(step) for step in range(10)]))
    with pytest.raises(InvalidInputError, match=r"data\.replay\[1\] has 7 training windows"):
        Sampler(num_samples=1000, micro_batch_size=4, micro_batches=2, dp=1, seed=7, replay=((300, 0.05), (7, 0.1)))


def test_joined_windows_follow_each_other(dataset_dir: Path, tmp_path: Path) -> None:
    from tests.train.conftest import write_dataset

    other = write_dataset(tmp_path / "other", seed=5, train_shards=1)
    a, b = TokenWindows(dataset_dir, "train", 16, 256), TokenWindows(other, "train", 16, 256)
    both = TokenWindows.joined([a, b])
    assert len(both) == len(a) + len(b)
    assert torch.equal(both.get([len(a) + 3, 2]), torch.cat([b.get([3]), a.get([2])]))


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
    with pytest.raises(InvalidInputError, match=r"manifest\.json: invalid manifest:\n  format"):
        TokenWindows(dataset_dir, "train", 16, 256)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_reassemble_to_the_reference_block(tp: int) -> None:
    m = ModelConfig(family="gpt", d_model=32, n_heads=4, n_kv_heads=2 if tp == 2 else 4, d_ff=64)
    full = TransformerBlock(m, 1, seed=3).state_dict()
    shards = [TransformerBlock(m, 1, seed=3, tp=TPGroup(None, Layout(tp=tp), Coord(tp=r))).state_dict()
              for r in range(tp)]
    for name, tensor in full.items():
        pieces = [s[name] for s in shards]
        torch.testing.assert_close(unshard(m, f"blocks.1.{name}", pieces), tensor, rtol=0, atol=0)
        if shard_spec(m, name, Layout(tp=tp), ORIGIN) is not None:
            assert pieces[0].numel() * tp == tensor.numel()
    assert set(GPT(m).state_dict()) >= {f"blocks.1.{n}" for n in full}


def test_pointer_prune_and_sweep(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    assert ck.read_latest(root) is None
    from tasks.runs.identity import RunIdentity, StartingWeights

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
    from tasks.base.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.zero_stage 0 with parallel\.tp > 1"):
        make_config({"parallel.tp": 2, "parallel.zero_stage": 0})


def test_snapshot_is_a_host_copy_the_training_step_cannot_change() -> None:
    """What the background save writes is the state at the snapshot, whatever the next steps do in place."""
    from collections import OrderedDict

    weight = torch.arange(4.0)
    state = {"module": OrderedDict(w=weight), "optimizer": {"state": {0: {"exp_avg": weight * 2, "step": 3}},
                                                            "param_groups": [{"lr": 0.1, "params": [0]}]},
             "shapes": [torch.Size([2, 2])]}
    engine = async_save.SnapshotEngine()
    engine.save(state, "/nowhere/mp_rank_00_model_states.pt")
    weight.add_(100.0)
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    [(path, snap)] = engine.take()
    assert path.endswith("mp_rank_00_model_states.pt") and engine.take() == []
    assert isinstance(snap["module"], OrderedDict) and snap["module"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert snap["optimizer"]["state"][0]["exp_avg"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert snap["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert type(snap["shapes"][0]) is torch.Size


def test_a_cpu_snapshot_writes_the_tensors_that_fill_their_storage_from_where_they_live(tmp_path: Path) -> None:
    """A CPU rank's snapshot (it waits for the write before its step changes anything) copies only the views into
    larger buffers (torch.save writes a whole storage: ZeRO's flat weights), and nothing of a tensor that fills its
    storage or does so but for ZeRO's padding (the fp32 master, Adam's moments); the files hold what they should."""
    n = 50_000  # 200 KB a tensor: more than the padding slack
    flat = torch.arange(2 * n, dtype=torch.float32)  # ZeRO's flat weights: each parameter a view
    master = torch.arange(n, dtype=torch.float32)
    padded = torch.zeros(n + 4).narrow(0, 0, n)  # a partition without its alignment padding
    state = {"module": {"a": flat[:n], "b": flat[n:]}, "master": master, "moment": padded}
    engine = async_save.SnapshotEngine(keep_host_tensors=True)
    engine.save(state, str(tmp_path / "f.pt"))
    [(path, snap)] = engine.take()
    assert snap["master"].data_ptr() == master.data_ptr() and snap["moment"].data_ptr() == padded.data_ptr()
    for name in ("a", "b"):  # copied out alone
        view = snap["module"][name]
        assert view.untyped_storage().nbytes() == n * 4 and torch.equal(view, state["module"][name])
    async_save.write_files([(path, snap)])
    loaded = torch.load(path)
    assert torch.equal(loaded["module"]["b"], flat[n:]) and torch.equal(loaded["master"], master)
    assert torch.equal(loaded["moment"], padded)

    gpu_rank = async_save.SnapshotEngine()  # a GPU rank never waits: every tensor is copied
    gpu_rank.save(state, str(tmp_path / "g.pt"))
    [(_, copied)] = gpu_rank.take()
    assert copied["master"].data_ptr() != master.data_ptr() and copied["moment"].data_ptr() != padded.data_ptr()


def test_a_snapshots_files_leave_host_memory_as_they_are_written(tmp_path: Path, monkeypatch) -> None:
    """The background save holds each file's host copy only until that file is written (not until the commit and
    the mirror's upload end), and lets all of them go when a write fails."""
    import gc
    import weakref

    def snapshot(n: int) -> tuple[list[tuple[str, Any]], list[weakref.ref[torch.Tensor]]]:
        engine = async_save.SnapshotEngine()
        for i in range(n):
            engine.save({"w": torch.full((1024,), float(i))}, str(tmp_path / f"f{i}.pt"))
        files = engine.take()
        return files, [weakref.ref(state["w"]) for _, state in files]

    files, alive = snapshot(3)
    held_at_write: list[list[bool]] = []
    product_write = async_save.write_file

    def watched_write(path: str, state: Any) -> None:
        gc.collect()
        held_at_write.append([ref() is not None for ref in alive])
        product_write(path, state)

    monkeypatch.setattr(async_save, "write_file", watched_write)
    async_save.write_files(files)
    gc.collect()
    assert held_at_write == [[True, True, True], [False, True, True], [False, False, True]]
    assert files == [] and not any(ref() is not None for ref in alive)
    assert [torch.load(tmp_path / f"f{i}.pt")["w"][0].item() for i in range(3)] == [0.0, 1.0, 2.0]

    files, alive = snapshot(3)

    def full_disk(path: str, state: Any) -> None:
        if path.endswith("f1.pt"):
            raise OSError(28, "No space left on device")
        product_write(path, state)

    monkeypatch.setattr(async_save, "write_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        async_save.write_files(files)
    gc.collect()
    assert files == [] and not any(ref() is not None for ref in alive)


def test_background_save_error_surfaces_on_the_training_thread() -> None:
    saver = async_save.BackgroundSaver()

    def disk_full() -> None:
        raise OSError(28, "No space left on device")

    saver.submit(disk_full)
    with pytest.raises(TrainingFailedError, match=r"background checkpoint save failed: OSError: .*No space left"):
        saver.wait()
    saver.wait()  # reported once; the saver is free again
