"""The parallel layout: how many ranks along each axis, and where a rank sits. Torch-free, so config, the
planner and the launchers read the same object the trainer builds its process groups from
(tasks/models/grid.py `build_grid`).

Rank order is DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model): TP innermost, then DP, then
PP, so a TP group is `tp` consecutive ranks and a DP group spans `tp x dp` (the planner's bandwidth model assumes
consecutive ranks share a node). Expert parallelism is carved out of the data-parallel ranks: `ep` consecutive
DP ranks form an expert group. Context parallelism has its field but no code yet: `cp` must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.base.errors import ConfigError

Axis = Literal["tp", "dp", "pp", "ep", "cp"]
# The axes a checkpoint records, in its order; `ep` and `cp` only where they are used (a marker written
# before them, or by a layout without them, reads the same).
RECORDED: tuple[Axis, ...] = ("tp", "pp", "dp")
OPTIONAL: tuple[Axis, ...] = ("ep", "cp")
# The axes a checkpoint's slices are cut along: a run resumes only at its checkpoint's (dp may change:
# tasks/train/reshard.py cuts its ZeRO partitions anew).
SLICED: tuple[Axis, ...] = ("tp", "pp", "ep", "cp")


@dataclass(frozen=True)
class Coord:
    """A rank's place in a layout: its index along each axis (`ep`: its rank in its expert group)."""

    pp: int = 0
    dp: int = 0
    tp: int = 0
    ep: int = 0


ORIGIN = Coord()


@dataclass(frozen=True)
class Layout:
    """Ranks along each axis; the world is their product (`ep` divides `dp` and adds no ranks)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in (*RECORDED, *OPTIONAL):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout.{axis} must be an integer >= 1, got {value!r}")
        if self.dp % self.ep:
            raise ConfigError(f"layout.ep ({self.ep}) must divide layout.dp ({self.dp}): expert parallelism is "
                              "carved out of the data-parallel ranks")
        if self.cp != 1:
            raise ConfigError(f"layout.cp ({self.cp}): context parallelism is not supported yet; it must be 1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coord(self, rank: int) -> Coord:
        """Where `rank` sits (DeepSpeed's order: TP innermost, then DP, then PP)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a layout of {self.world_size} ranks")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return Coord(pp=pp, dp=dp, tp=tp, ep=self.ep_index(dp))

    def ep_index(self, dp: int) -> int:
        """The expert-parallel rank of data-parallel index `dp`: `ep` consecutive DP ranks form an expert group
        (DeepSpeed's `_get_expert_parallel_ranks` order), each holding 1 / ep of every routed layer's experts."""
        return dp % self.ep

    def expert_group(self, dp: int) -> list[int]:
        """The data-parallel indices of `dp`'s expert-parallel group (the all-to-all's ranks), by expert rank."""
        first = dp - self.ep_index(dp)
        return list(range(first, first + self.ep))

    def expert_replicas(self, ep_index: int) -> list[int]:
        """The data-parallel indices holding expert rank `ep_index`'s experts, in order: its expert-data-parallel
        group, over which those experts' gradients are reduced and their ZeRO partitions cut."""
        return [dp for dp in range(self.dp) if self.ep_index(dp) == ep_index]

    def rank(self, at: Coord) -> int:
        """The rank at `at` (inverse of `coord`)."""
        for axis in ("pp", "dp", "tp"):
            if not 0 <= getattr(at, axis) < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {getattr(at, axis)} outside {self.describe()}")
        return (at.pp * self.dp + at.dp) * self.tp + at.tp

    def span(self, axis: Literal["tp", "dp", "pp", "ep"]) -> int:
        """Consecutive ranks one group along `axis` covers (a TP group: tp; a DP group: tp x dp; an expert-parallel
        group: tp x ep; PP: the world)."""
        return {"tp": self.tp, "dp": self.tp * self.dp, "ep": self.tp * self.ep, "pp": self.world_size}[axis]

    def record(self) -> dict[str, int]:
        """The layout as checkpoints, summaries and plans record it (`{"tp", "pp", "dp"}` plus any axis in use)."""
        return {axis: getattr(self, axis) for axis in RECORDED} | {
            axis: getattr(self, axis) for axis in OPTIONAL if getattr(self, axis) != 1}

    def describe(self, axes: tuple[Axis, ...] = (*RECORDED, *OPTIONAL)) -> str:
        """`tp=2 pp=1 dp=4` for logs and messages (of `axes`, those `record` has)."""
        return describe_record({axis: value for axis, value in self.record().items() if axis in axes})


ONE_RANK = Layout()


def describe_record(record: dict[str, object]) -> str:
    """A recorded layout (`Layout.record`, as a plan or summary holds it) as `tp=2 pp=1 dp=4`."""
    return " ".join(f"{axis}={record[axis]}" for axis in (*RECORDED, *OPTIONAL) if axis in record)


def recorded_axis(record: dict[str, object], axis: Axis) -> object:
    """`axis` as `record` (a checkpoint's layout) has it: an optional axis it leaves out is 1."""
    return record.get(axis, 1 if axis in OPTIONAL else None)
