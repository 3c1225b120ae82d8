"""RankJobTrigger: follows a submitted rank job from Airflow's triggerer, so no worker is held while it runs.

The trigger is persisted with the run's frozen config (its resolved document: `${VAR}`s
unexpanded, no secret; building the config from it reads nothing, so nothing blocks the event
loop) and the job's handle; a triggerer restart re-creates it and it
follows the same job on. It fires once, with the job's outcome (ended, hung, past its
deadline), and the task resumes only to collect it. A user killing the deferred task
(mark failed / success, clear) cancels the job on every node (`on_kill`); a triggerer
restart or shutdown does not touch it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from tasks import launch as launching
from tasks.models.resolve import ConfigSnapshot

log = logging.getLogger(__name__)


class RankJobTrigger(BaseTrigger):
    def __init__(self, snapshot: dict[str, Any], job: dict[str, Any]) -> None:
        super().__init__()
        self.snapshot, self.job = snapshot, job

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"snapshot": self.snapshot, "job": self.job}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        cfg = ConfigSnapshot.from_dict(self.snapshot).config()  # resolved at plan time: no I/O on the event loop
        log.info("following the %s job of %s (%s)", self.job["what"], cfg.name, self.job["engine"])
        outcome = await launching.follow(cfg, self.job, deadline=self.job.get("deadline"))
        yield TriggerEvent({"job": self.job, "outcome": outcome.to_dict()})

    async def on_kill(self) -> None:
        cfg = ConfigSnapshot.from_dict(self.snapshot).config()
        log.warning("the task was killed: cancelling the %s job of %s on every node", self.job["what"], cfg.name)
        await asyncio.to_thread(launching.cancel, cfg, self.job)
