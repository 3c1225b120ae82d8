"""How a followed rank job ended: what `Launcher.follow` reports and `Launcher.collect` turns into the summary.

Why its own value: between the two it crosses a process boundary (Airflow's triggerer follows the job, the
task collects it; the trigger's event is JSON), so it has one JSON shape, written and read here only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tasks.base.rank_failure import RankFailure


@dataclass(frozen=True)
class Outcome:
    """`rc`: the job's exit status (1 for one cancelled as hung or overdue); `failure`: the reason a rank wrote
    in the status file; `last_step`: the last step the status showed; `rank_failure`: the earliest failure a
    node's spawner reported; `preempted`: the cluster took the job away; `hung` / `timed_out`: why the follower
    cancelled it (the watcher's description, or the deadline passed)."""

    rc: int
    failure: str | None
    last_step: int | None
    rank_failure: RankFailure | None
    preempted: bool
    hung: str | None = None
    timed_out: str | None = None

    def to_dict(self) -> dict[str, Any]:
        cancelled = ({"hung": self.hung} if self.hung is not None
                     else {"timed_out": self.timed_out} if self.timed_out is not None else {})
        return {**cancelled, "rc": self.rc, "failure": self.failure, "last_step": self.last_step,
                "rank_failure": None if self.rank_failure is None else asdict(self.rank_failure),
                "preempted": self.preempted}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        return cls(rc=data["rc"], failure=data["failure"], last_step=data["last_step"],
                   rank_failure=RankFailure.from_dict(data.get("rank_failure")), preempted=data["preempted"],
                   hung=data.get("hung"), timed_out=data.get("timed_out"))
