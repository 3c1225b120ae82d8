"""Promotion by hand: a published version onto an alias, through that alias's gate and its approvers.

A rollback only goes back (tasks/registry/core.py refuses anything else); putting a version on an alias it
was not live on (staging's v5 onto production) is a promotion, and a promotion is held to what a retrain's
publish is held to: the alias's gate compares the version with the alias's live one on the config's suites
(both scored by evaluation ranks, or from the cache), then the alias's approval step, then one audited
compare-and-swap on the live version the gate judged against, recorded as `promote` under the approver.
`force` skips the gate (and may put back a version a rollback took off the alias), never the approval, and
only for the alias's movers. The `promote_model` DAG runs these stages with a person's approval between gate
and move; `retrainer promote` runs them in one process, where nobody can approve, so an alias that requires
approval is refused there before anything is scored.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.base.audit import default_actor
from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.policy import Person, check_mover
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.evaluate import VersionsScored, score_versions
from tasks.models.resolve import ConfigSnapshot
from tasks.registry import ForceRequiredError, NothingToRollBackError, SwitchRecord
from tasks.stages.gate import GateDecision, judge
from tasks.stages.publish import require_approval

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Promotion:
    """What a promotion moves, frozen when it starts: the config (its `publish.alias` is the target alias),
    the version, the version live on the alias then (the gate judges against it; the move is a compare-and-swap
    on it), and whether the gate is skipped."""

    job: ConfigSnapshot
    version: int
    live_version: int | None
    force: bool
    reason: str

    def config(self) -> JobConfig:
        return self.job.config()

    def to_xcom(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "job": self.job.to_dict()}

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Promotion:
        return cls(**{**data, "job": ConfigSnapshot.from_dict(data["job"])})


def stage_promote_check(job: ConfigSnapshot, version: int | None, *, force: bool = False, reason: str = "",
                        requester: Person | None = None) -> Promotion:
    """Refuse what cannot be promoted before anything is scored: no or an unknown version, the live one, a
    forced promotion without a reason or by someone the alias's movers do not admit (`requester`: None where
    no person is known, at a command line)."""
    if version is None or isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidInputError(f"version: the version to promote, a number >= 1 (got {version!r})")
    cfg = job.config()
    model, alias = cfg.publish.model_name, cfg.publish.alias
    if force:
        if requester is not None:
            check_mover(cfg.publish.policy_for(alias), alias, requester, "force a promotion past the gate of")
        if not reason.strip():
            raise InvalidInputError(f"reason: a forced promotion onto {alias!r} (past its gate) needs a reason")
    reg = registry_for(cfg)
    reg.get_version(model, version)  # NotFoundError naming it
    live = reg.live_version(model, alias)
    if live is not None and live.version == version:
        raise NothingToRollBackError(f"model {model!r} alias {alias!r} already points to version {version}")
    back = None if force else reg.rollbacks(model, alias).get(version)
    if back is not None:  # the switch would refuse it too: say so before the cluster scores anything
        raise ForceRequiredError(f"model {model!r} alias {alias!r}: version {version} was rolled back from it by "
                                 f"{back.actor} at {back.at} (reason: {back.reason!r}); putting it back takes force "
                                 "and a reason (--force --reason WHY; the promote_model DAG: force)")
    return Promotion(job, version, None if live is None else live.version, force, reason)


def stage_promote_evaluate(promotion: Promotion) -> VersionsScored:
    """Score the version and the alias's live one on the config's suites (the config's current data, warmed
    here, for a suite without its own source), as the gate of a retrain does."""
    from tasks.data.warm import warm_for_config
    from tasks.stages.lifecycle import stage_identify

    cfg = promotion.config()
    reg = registry_for(cfg)
    candidate = reg.get_version(cfg.publish.model_name, promotion.version)
    live = None if promotion.live_version is None else reg.get_version(cfg.publish.model_name,
                                                                       promotion.live_version)
    run = stage_identify(cfg)
    warmed = warm_for_config(cfg)
    if warmed.manifest_hash != run.data_manifest_hash:
        raise RetrainerError(f"{run.data_url}: the dataset changed while the promotion started (manifest "
                             f"{run.data_manifest_hash[:12]} then, {warmed.manifest_hash[:12]} now); start it again")
    eval_root = Path(cfg.train.output_dir) / "promotions"
    return score_versions(cfg, run, candidate, live, Path(warmed.dataset_dir), eval_root)


def stage_promote_gate(promotion: Promotion, scored: VersionsScored) -> GateDecision:
    """The alias's gate rules on the two versions' numbers (the refusal names each rule that failed)."""
    cfg = promotion.config()
    live = None if scored.live is None else scored.live.metrics
    decision = judge(cfg.evaluate.rules(), scored.candidate.metrics, live, promotion.live_version,
                     f"{cfg.evaluate.suites[0].name}.loss")
    decision = dataclasses.replace(decision, candidate_version=promotion.version)
    (log.info if decision.publish else log.warning)("promote gate: %s", decision.reason)
    return decision


def stage_promote(promotion: Promotion, decision: GateDecision | None, *, actor: str,
                  approved_by: str | None = None, comment: str = "") -> SwitchRecord:
    """Move the alias onto the version: only past its gate (or forced), only with an approval where its policy
    requires one, and only if the alias still points where it did when the promotion started."""
    cfg = promotion.config()
    model, alias = cfg.publish.model_name, cfg.publish.alias
    require_approval(cfg, approved_by)
    if decision is None and not promotion.force:
        raise InvalidInputError(f"promoting v{promotion.version} onto {alias!r}: no gate decision (only a forced "
                                "promotion skips the gate)")
    if decision is not None and not decision.publish:
        raise InvalidInputError(f"promoting v{promotion.version} onto {alias!r}: {decision.reason}")
    why = [promotion.reason or "promote",
           "gate skipped (forced)" if decision is None else f"gate: {decision.reason}"]
    if approved_by:
        why.append(f"approved by {approved_by}" + (f": {comment}" if comment else ""))
    record = registry_for(cfg).switch_alias(model, alias, promotion.version, expect=promotion.live_version,
                                            actor=actor, reason="; ".join(why), action="promote",
                                            force=promotion.force)
    log.info("promote: %s/%s moved v%s -> v%s by %s", model, alias, record.from_version, record.to_version, actor)
    return record


def promote(job: ConfigSnapshot, version: int, *, force: bool = False, reason: str = "",
            actor: str | None = None) -> SwitchRecord:
    """`retrainer promote`: the stages in one process, without a person to approve (an alias that requires
    approval is refused first, before anything is scored)."""
    require_approval(job.config(), None)
    promotion = stage_promote_check(job, version, force=force, reason=reason)
    decision = None if force else stage_promote_gate(promotion, stage_promote_evaluate(promotion))
    return stage_promote(promotion, decision, actor=actor or default_actor())
