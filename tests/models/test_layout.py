"""The layout type: validation, one rank order (DeepSpeed's), and what it records."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.base.errors import ConfigError
from tasks.base.layout import ONE_RANK, Coord, Layout, describe_record, recorded_axis
from tasks.config.evaluation import EvalParallel
from tasks.config.schema import ParallelConfig
from tasks.models.grid import topology


def test_axes_default_to_one_and_multiply_to_the_world() -> None:
    assert Layout(dp=1, tp=1, pp=1, ep=1, cp=1) == ONE_RANK and ONE_RANK.world_size == 1
    assert Layout(tp=2, pp=3, dp=4).world_size == 24
    assert Layout(dp=4, ep=2).world_size == 4  # expert parallelism is carved out of dp: no ranks of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout().tp = 2  # type: ignore[misc]


@pytest.mark.parametrize(("fields", "message"), [
    ({"tp": 0}, r"layout\.tp must be an integer >= 1, got 0"),
    ({"dp": -2}, r"layout\.dp must be an integer >= 1"),
    ({"pp": 1.5}, r"layout\.pp must be an integer >= 1"),
    ({"pp": True}, r"layout\.pp must be an integer >= 1"),
    ({"dp": 4, "ep": 3}, r"layout\.ep \(3\) must divide layout\.dp \(4\)"),
    ({"cp": 2}, r"layout\.cp \(2\): context parallelism is not supported yet"),
])
def test_a_bad_axis_is_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Layout(**fields)  # type: ignore[arg-type]


def test_rank_order_is_deepspeeds() -> None:
    """tp innermost, then dp, then pp: the coordinates DeepSpeed's PipeModelDataParallelTopology gives."""
    layout = Layout(tp=2, pp=2, dp=3)
    topo = topology(layout)
    assert topo.world_size() == layout.world_size
    for rank in range(layout.world_size):
        ds = topo.get_coord(rank)
        at = layout.coord(rank)
        assert (at.pp, at.dp, at.tp) == (ds.pipe, ds.data, ds.model), rank
        assert layout.rank(at) == rank == topo.get_rank(pipe=at.pp, data=at.dp, model=at.tp)
    # Pinned: consecutive ranks are one TP group; a DP group strides by tp; the stages by tp x dp.
    assert [layout.coord(r) for r in (0, 1, 2, 5, 6, 11)] == [
        Coord(pp=0, dp=0, tp=0), Coord(pp=0, dp=0, tp=1), Coord(pp=0, dp=1, tp=0), Coord(pp=0, dp=2, tp=1),
        Coord(pp=1, dp=0, tp=0), Coord(pp=1, dp=2, tp=1)]
    assert (layout.span("tp"), layout.span("dp"), layout.span("pp")) == (2, 6, 12)


def test_the_expert_rank_is_the_dp_rank_within_its_group() -> None:
    layout = Layout(tp=2, dp=4, ep=2)
    assert [layout.coord(r).ep for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_expert_groups_and_replicas_partition_the_data_parallel_ranks() -> None:
    """An expert group: ep consecutive DP ranks (one of each expert rank); an expert rank's replicas: one DP rank of
    every group. Together they tile dp, and each DP rank sits in one of each (the all-to-all's group and the
    experts' gradient reduction / ZeRO partition group, which a resume at another dp re-cuts)."""
    layout = Layout(dp=6, ep=3)
    assert layout.expert_group(4) == [3, 4, 5] and layout.expert_replicas(1) == [1, 4]
    for dp in range(6):
        assert [layout.ep_index(k) for k in layout.expert_group(dp)] == [0, 1, 2]
        assert dp in layout.expert_replicas(layout.ep_index(dp))
    assert sorted(d for e in range(3) for d in layout.expert_replicas(e)) == list(range(6))
    assert Layout(dp=4).expert_replicas(0) == [0, 1, 2, 3] and Layout(dp=4).expert_group(2) == [2]


def test_coordinates_outside_the_layout_are_refused() -> None:
    layout = Layout(tp=2, dp=2)
    with pytest.raises(ValueError, match="rank 4 outside a layout of 4 ranks"):
        layout.coord(4)
    with pytest.raises(ValueError, match="tp coordinate 2 outside tp=2 pp=1 dp=2"):
        layout.rank(Coord(tp=2))


def test_the_record_keeps_todays_keys_and_adds_an_axis_only_in_use() -> None:
    assert Layout(tp=2, pp=1, dp=4).record() == {"tp": 2, "pp": 1, "dp": 4}
    assert Layout(dp=4, ep=2).record() == {"tp": 1, "pp": 1, "dp": 4, "ep": 2}
    assert Layout(tp=2, dp=4, ep=4).describe() == "tp=2 pp=1 dp=4 ep=4"
    assert describe_record({"dp": 2, "zero_stage": 1, "tp": 4, "pp": 1}) == "tp=4 pp=1 dp=2"
    assert recorded_axis({"tp": 2, "pp": 1, "dp": 1}, "ep") == 1  # a marker written before ep
    assert recorded_axis({}, "tp") is None


def test_the_config_gives_the_layout_of_its_keys() -> None:
    assert ParallelConfig(tp=2, pp=3, dp=4).layout == Layout(tp=2, pp=3, dp=4)
    assert ParallelConfig(tp=2, pp=3, dp=4).layout.world_size == 24
    assert EvalParallel(dp=2).layout == Layout(dp=2)
