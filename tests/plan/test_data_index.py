"""The plan counts what every training rank keeps to index its windows: read from the manifests before any rank
starts, it must equal (a chat split: bound) what `TokenWindows` and the `Sampler` hold once they do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.base.dataset_format import PlannedData, SplitShape, packed_windows_bound
from tasks.data.manifest import read_manifest
from tasks.data.packing import pack_windows
from tasks.plan import plan
from tasks.train.data import Sampler, TokenWindows
from tests.plan.conftest import make_config


def _held_bytes(windows: TokenWindows, sampler: Sampler) -> int:
    """Every array a training rank keeps for the split: the index, a chat split's members, ends and document
    starts, and the sampler's permutation of the epoch (drawn by the first step)."""
    sampler.global_indices(0)
    arrays = [windows.index, windows.ends, windows.members, *windows.starts,
              *(permutation for _, permutation in sampler._drawn.values())]
    return sum(a.nbytes for a in arrays)


def _sampler(windows: TokenWindows) -> Sampler:
    return Sampler(len(windows), micro_batch_size=1, micro_batches=1, dp=1, seed=3)


def test_a_plain_split_is_indexed_with_exactly_the_bytes_the_manifest_gives(tmp_path: Path) -> None:
    from tests.train.conftest import write_dataset

    root = write_dataset(tmp_path / "ds", train_shards=3, tokens_per_shard=8192 + 5)
    shape = read_manifest(str(root)).split_shape("train", 16)
    windows = TokenWindows(root, "train", 16, 256)
    assert shape == SplitShape(windows=len(windows)) and shape.windows == 3 * 512
    assert shape.index_bytes(sampled=True) == _held_bytes(windows, _sampler(windows)) == 24 * 3 * 512
    assert shape.index_bytes(sampled=False) == windows.index.nbytes  # an evaluation split: no permutation


def test_a_chat_split_is_indexed_within_the_bound_the_manifest_gives(tmp_path: Path) -> None:
    from tests.chat import LLAMA3
    from tests.train.test_packed import SEQ, chat_dataset

    root = chat_dataset(tmp_path, LLAMA3, 60)
    shape = read_manifest(str(root)).split_shape("train", SEQ)
    windows = TokenWindows(root, "train", SEQ, 512)
    documents = sum(len(starts) - 1 for starts in windows.starts)  # each shard's starts end with its token count
    assert shape.packed and shape.documents == documents == 60
    assert len(windows) <= shape.windows < documents
    exact = SplitShape(len(windows), documents, packed=True).index_bytes(sampled=True)
    assert exact + 8 * len(windows.starts) == _held_bytes(windows, _sampler(windows))


@pytest.mark.parametrize("seed", range(6))
def test_packing_never_opens_more_windows_than_the_bound(seed: int) -> None:
    """Any two windows of the best-fit packing hold more than one window's tokens; the lengths include the
    worst case for it, documents just over half a window (one a window)."""
    rng = np.random.default_rng(seed)
    capacity = 129
    for lengths in (rng.integers(1, capacity + 1, 500), rng.integers(1, 20, 500), np.full(200, capacity // 2 + 1),
                    rng.integers(capacity // 2 - 3, capacity // 2 + 4, 300)):
        packed = len(pack_windows(lengths, capacity)[1]) - 1
        assert packed <= packed_windows_bound(int(lengths.sum()), len(lengths), capacity - 1)
    assert len(pack_windows(np.full(200, capacity // 2 + 1), capacity)[1]) - 1 == 200  # the bound is met there


def test_the_index_is_on_every_rank_for_its_whole_life_gpu_or_cpu() -> None:
    """24M windows (a 100B-token split at seq 4096): 0.54 GiB on every rank, in its host memory on a GPU too."""
    cfg = make_config(parallel={"pp": 2})
    data = PlannedData(train_index_bytes=SplitShape(24_000_000).index_bytes(sampled=True))
    for device in ("cpu", "gpu"):
        without, with_index = plan(cfg, device=device), plan(cfg, device=device, data=data)
        assert with_index.memory.data_index == 576_000_000
        for a, b in zip(without.stages, with_index.stages, strict=True):
            assert b["process_total"] - a["process_total"] == 576_000_000 == b["process"]["data_index"]
        assert with_index.memory.host_node_peak > without.memory.host_node_peak


def test_planned_data_reads_the_data_each_replay_source_and_each_suite(tmp_path: Path) -> None:
    """The training ranks index the train splits of the data and every replay source together; an evaluation
    rank one suite's split at a time (the largest counted), a suite with its own dataset read from its manifest."""
    from tasks.config.schema import JobConfig
    from tasks.data.sources import planned_data
    from tests.train.conftest import write_dataset

    data = write_dataset(tmp_path / "data", train_shards=2, heldout_tokens=4096)
    replay = write_dataset(tmp_path / "replay", train_shards=1, seed=4)
    suite = write_dataset(tmp_path / "suite", train_shards=1, heldout_tokens=16384, seed=5)
    base = make_config(model={"seq_len": 16, "vocab_size": 256}).model_dump(mode="json")
    cfg = JobConfig.model_validate({
        **base,
        "data": {**base["data"], "source_url": str(data), "replay": [{"source_url": str(replay), "weight": 0.25}]},
        "evaluate": {**base["evaluate"], "suites": [{"name": "heldout"},
                                                    {"name": "other", "source_url": str(suite)}]},
    })
    planned = planned_data(cfg)
    train = sum(len(TokenWindows(d, "train", 16, 256)) for d in (data, replay))
    largest = max(len(TokenWindows(d, "heldout", 16, 256)) for d in (data, suite))
    assert planned == PlannedData(packed=False, train_index_bytes=24 * train, eval_index_bytes=16 * largest)
    assert largest == 1023 > len(TokenWindows(data, "heldout", 16, 256))  # the suite's own split, the larger

    result = plan(cfg, device="cpu", data=planned)
    assert result.evaluation is not None and result.evaluation["data_index"] == 16 * largest
    alone = plan(cfg, device="cpu").evaluation
    assert alone is not None and result.evaluation["process_total"] == alone["runtime"] + max(
        alone["total"] + 16 * largest, alone["weights"] + alone["weights_file_pages"])
