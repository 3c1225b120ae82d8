"""The publish gate: a new model reaches an alias only if it is not worse than the live one.

Both models are scored on the *same* held-out data (the live model is fetched
from the artifact store, digest-verified, and evaluated again), so a change of
dataset between runs cannot make a worse model look better.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateDecision:
    publish: bool
    reason: str
    new_loss: float
    live_loss: float | None
    live_version: int | None

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
