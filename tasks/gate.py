"""The publish gate: a new model reaches an alias only if it is not worse than the live one, and never if
it is a version an operator rolled back from that alias.

Both models are scored on the *same* held-out data (the live model is fetched
from the artifact store, digest-verified, and evaluated again), so a change of
dataset between runs cannot make a worse model look better. A candidate that is
an already published version (same experiment key and checkpoint: same weights)
is judged as that version: if a rollback moved the alias away from it, an
automatic run does not put it back (only an explicit `retrainer promote` can).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

    def to_dict(self) -> dict:
        return asdict(self)


def decide(new_loss: float, live_loss: float | None, tolerance: float, live_version: int | None = None) -> GateDecision:
    """Publish when there is no live model, or new <= live x (1 + tolerance)."""
    if live_loss is None:
        return GateDecision(True, "no live model: first version", new_loss, None, None)
    limit = live_loss * (1.0 + tolerance)
    if new_loss <= limit:
        reason = (f"held-out loss {new_loss:.4f} <= live v{live_version} {live_loss:.4f} "
                  f"x (1 + {tolerance}) = {limit:.4f}")
        return GateDecision(True, reason, new_loss, live_loss, live_version)
    reason = (f"held-out loss {new_loss:.4f} is worse than live v{live_version} {live_loss:.4f} "
              f"x (1 + {tolerance}) = {limit:.4f}: not published")
    return GateDecision(False, reason, new_loss, live_loss, live_version)


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
    reason = (f"candidate is {model} v{v} (same run and checkpoint), which was rolled back from {alias} "
              f"(v{v} -> v{back.to_version} by {back.actor} at {back.at}: {back.reason!r}); an automatic run "
              f"never re-promotes a rolled-back version: not published (explicitly: retrainer promote --model "
              f"{model} --alias {alias} --version {v} --reason ...)")
    return GateDecision(False, reason, new_loss, None, live_version, v)
