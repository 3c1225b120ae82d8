"""The publish gate: a new model reaches an alias only if it is not worse than the live one, and never if
it is a version an operator rolled back from that alias.

Both models are scored on the *same* suites (the evaluate stage scores the live
model in the same rank job, or takes its cached numbers on exactly these suites),
so a change of dataset between runs cannot make a worse model look better. The
decision is a list of rules (`evaluate.gate.rules`: a metric, a direction, a
tolerance against live or an absolute threshold), each recorded with its result. A candidate that is
an already published version (same experiment key and checkpoint: same weights)
is judged as that version: if a rollback moved the alias away from it, an
automatic run does not put it back (only an explicit, forced promotion can).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.config.evaluation import GateRule
    from tasks.registry import SwitchRecord, VersionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateDecision:
    publish: bool
    reason: str
    new_loss: float
    live_loss: float | None
    live_version: int | None
    candidate_version: int | None = None  # set when the candidate is an already published version
    rules: tuple[dict, ...] = ()  # every rule's result (recorded with the version)

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> GateDecision:
        return cls(**{**data, "rules": tuple(data.get("rules", ()))})


def check_rule(index: int, rule: GateRule, candidate: dict[str, float], live: dict[str, float] | None,
               live_version: int | None) -> dict:
    """One rule's verdict on the candidate's metrics: what was compared, the limit, passed or not, in words."""
    new = candidate[rule.metric]
    better = "<=" if rule.direction == "min" else ">="
    name = f"evaluate.gate.rules[{index}] ({rule.metric} {rule.direction}"
    reference: float | None = None
    if rule.against == "absolute":
        assert rule.threshold is not None
        limit: float | None = rule.threshold
        name += f", threshold {rule.threshold:g})"
        what = f"threshold {limit:.6g}"
    elif live is None:
        limit = None
        name += " vs live)"
        what = "no live model"
    else:
        reference = live[rule.metric]
        allowed = rule.tolerance * abs(reference) if rule.tolerance_kind == "relative" else rule.tolerance
        limit = reference + allowed if rule.direction == "min" else reference - allowed
        unit = f"{rule.tolerance:g} relative" if rule.tolerance_kind == "relative" else f"{rule.tolerance:g}"
        name += f" vs live, tolerance {unit})"
        what = f"live v{live_version} {reference:.6g} -> limit {limit:.6g}"
    passed = limit is None or (new <= limit if rule.direction == "min" else new >= limit)
    note = (f"{name}: {new:.6g} ({what})" if limit is None else
            f"{name}: {new:.6g} {better if passed else ('>' if rule.direction == 'min' else '<')} "
            f"{limit:.6g} ({what})")
    return {"rule": index, "metric": rule.metric, "direction": rule.direction, "against": rule.against,
            "candidate": new, "reference": reference, "limit": limit, "passed": passed, "note": note}


def judge(rules: tuple[GateRule, ...], candidate: dict[str, float], live: dict[str, float] | None,
          live_version: int | None, loss_metric: str) -> GateDecision:
    """Publish when every rule passes; the refusal names each rule that failed."""
    results = tuple(check_rule(i, r, candidate, live, live_version) for i, r in enumerate(rules))
    failed = [r for r in results if not r["passed"]]
    new_loss, live_loss = candidate[loss_metric], None if live is None else live[loss_metric]
    if failed:
        reason = "refused by " + "; ".join(r["note"] for r in failed) + ": not published"
    elif live is None:
        reason = "no live model: first version" + "".join(
            f"; {r['note']}" for r in results if r["against"] == "absolute")
    else:
        reason = "; ".join(r["note"] for r in results)
    return GateDecision(not failed, reason, new_loss, live_loss, live_version, rules=results)


def known_candidate(model: str, alias: str, new_loss: float, candidate: VersionRecord | None,
                    live: VersionRecord | None, rollbacks: dict[int, SwitchRecord]) -> GateDecision | None:
    """The decision for a candidate that is already a published version, or None to compare losses."""
    if candidate is None:
        return None
    v = candidate.version
    live_version = live.version if live else None
    if live_version == v:
        return GateDecision(False, f"candidate is {model} v{v}, already live on {alias}: nothing to publish",
                            new_loss, None, live_version, v)
    back = rollbacks.get(v)
    if back is None:
        return None
    return GateDecision(False, rolled_back_reason(model, alias, v, back), new_loss, None, live_version, v)


def rolled_back_reason(model: str, alias: str, version: int, back: SwitchRecord) -> str:
    """Why a candidate that is version `version`, rolled back from `alias` by `back`, is not published (the
    gate says it after evaluating; a run whose result is known to be that version says it before)."""
    return (f"candidate is {model} v{version} (same run and checkpoint), which was rolled back from {alias} "
            f"(v{version} -> v{back.to_version} by {back.actor} at {back.at}: {back.reason!r}); an automatic run "
            f"never re-promotes a rolled-back version: not published (explicitly, by a mover of {alias}: the "
            f"promote_model DAG with force, or retrainer promote CONFIG --alias {alias} --version {version} --force "
            "--reason ...)")
