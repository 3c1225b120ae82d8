"""A failed deploy moves the alias back (compare-and-swap on the version that failed, audited with why), once:
a version live because of a rollback is never rolled back again."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tasks.config.schema import JobConfig
from tasks.deploy.target import DeployError, DeployTarget
from tasks.registry import ConflictError, NothingToRollBackError
from tasks.stages.lifecycle import stage_rollback

if TYPE_CHECKING:
    from tasks.registry import SwitchRecord

log = logging.getLogger(__name__)

_MAX_REASON = 1500  # of a failure, as it goes into the alias history (tasks.registry.names.MAX_REASON is 2000)


def failure_reason(exc: BaseException, step: str) -> str:
    """The audited reason of a failed step: a DeployError says it already, anything else is named by step."""
    text = str(exc) if isinstance(exc, DeployError) else f"{step} failed: {type(exc).__name__}: {exc}"
    return text[:_MAX_REASON]


def unrecorded_failure(steps: list[str]) -> str:
    """The reason when a failed step's process died before it could say why (killed, out of memory, worker lost)."""
    named = " and ".join(steps) or "a deploy step"
    return f"{named} failed without a recorded reason (its process was killed or its worker lost; see its log)"


def roll_back(cfg: JobConfig, target: DeployTarget | None, failure: str, *, actor: str) -> SwitchRecord:
    """Move the alias back from the version whose deploy failed (compare-and-swap on it), audited with `failure`.

    Refused, loudly (DeployError), when the version got there by a rollback itself (no cascade), when the alias
    moved since (that move deploys on its own), or when there is nothing to go back to."""

    if target is None:
        raise DeployError(f"deploy failed before the live version was known ({failure}); nothing rolled back")
    where = f"{target.model} v{target.version} ({target.alias})"
    if target.via_rollback:
        raise DeployError(
            f"deploy of {where} failed: {failure}. v{target.version} is live because of a rollback (from "
            f"v{target.moved_from}), so it is not rolled back again: serving needs a person")
    try:
        out = stage_rollback(cfg, alias=target.alias, expect=target.version, actor=actor,
                             reason=f"deploy: {failure}"[:_MAX_REASON])
    except ConflictError as exc:
        raise DeployError(f"deploy of {where} failed: {failure}; not rolled back, the alias moved since "
                          f"({exc}): that move's event deploys it") from None
    except NothingToRollBackError as exc:
        raise DeployError(f"deploy of {where} failed: {failure}; and there is nothing to roll back to "
                          f"({exc})") from None
    log.error("deploy: %s failed (%s): rolled %s back to v%d", where, failure, target.alias, out.to_version)
    return out
